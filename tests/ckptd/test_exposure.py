"""What a daemon shows and says about its exposure: URLs without credentials, warnings for open endpoints,
and failures that repeat (out of descriptors) said once a minute."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging

import pytest

from ckptd.config import Config
from ckptd.daemon import ACCEPT_OUT_OF_RESOURCES, _paced_accept_failures, exposure_warnings
from ckptd.log_pace import LogPace
from ckptd.storage.object_store import shown_url
from ckptd.tiers.step_records import entry_names


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://AKIA123:secret@bucket/prefix", "s3://***@bucket/prefix"),
        ("https://user@host:9000/b/p", "https://***@host:9000/b/p"),
        ("s3://bucket/prefix/with@at", "s3://bucket/prefix/with@at"),  # an @ in the path is no credential
        ("file:///srv/ckpt", "file:///srv/ckpt"),
        ("s3://bucket", "s3://bucket"),
    ],
)
def test_a_url_is_shown_without_the_credentials_written_into_it(url, shown):
    assert shown_url(url) == shown
    assert "secret" not in shown_url(url) and "AKIA" not in shown_url(url)


def test_metrics_beyond_loopback_and_etcd_without_tls_are_warned_at_start():
    base = Config()
    assert exposure_warnings(base) == []
    local = dataclasses.replace(base, metrics=dataclasses.replace(base.metrics, listen="127.0.0.1:9464"))
    assert exposure_warnings(local) == []
    wide = dataclasses.replace(base, metrics=dataclasses.replace(base.metrics, listen="0.0.0.0:9464"))
    assert ["0.0.0.0:9464" in w and "without authentication" in w for w in exposure_warnings(wide)] == [True]
    etcd = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, backend="etcd", endpoints=("e:2379",)))
    assert ["etcd without TLS" in w for w in exposure_warnings(etcd)] == [True]
    tls = dataclasses.replace(etcd, cluster=dataclasses.replace(etcd.cluster, cert="c", key="k", ca="a"))
    assert exposure_warnings(tls) == []


def test_accept_failing_for_want_of_descriptors_is_said_once_a_minute_not_at_every_retry(caplog):
    loop = asyncio.new_event_loop()
    try:
        handle = _paced_accept_failures(LogPace())
        out_of_descriptors = {"message": ACCEPT_OUT_OF_RESOURCES, "exception": OSError(errno.EMFILE, "Too many")}
        with caplog.at_level(logging.ERROR):
            for _ in range(100):  # asyncio retries a second apart, for as long as it lasts
                handle(loop, out_of_descriptors)
            handle(loop, {"message": "something else went wrong"})
            handle(loop, {"message": "something else went wrong"})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "cannot accept connections" in line]) == 1
    assert len([line for line in lines if "something else went wrong" in line]) == 2  # not paced


def test_a_directory_that_cannot_be_listed_is_said_once_a_minute_not_at_every_peering_round(tmp_path, caplog):
    loop_link = tmp_path / "loop"
    loop_link.symlink_to(loop_link)  # ELOOP at every listing, as EMFILE is while descriptors run out
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            assert entry_names(loop_link) == []
    assert len([r for r in caplog.records if "cannot list" in r.getMessage()]) == 1
