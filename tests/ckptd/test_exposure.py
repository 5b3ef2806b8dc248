"""What a daemon shows and says about its exposure: URLs without credentials, warnings for open endpoints."""

from __future__ import annotations

import dataclasses

import pytest

from ckptd.config import Config
from ckptd.daemon import exposure_warnings
from ckptd.storage.object_store import shown_url


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
