"""The thin etcd client against a real etcd server: keys, create-once, leases, watches, failover, TLS."""

from __future__ import annotations

import asyncio

import pytest
from certs import CertificateAuthority
from conftest import free_port
from etcd_server import EtcdServer

from ckptd.cluster.etcd_client import EtcdClient, EtcdCompacted, EtcdError, EtcdUnavailable, prefix_end

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def run(coroutine_fn, *args):
    return asyncio.run(coroutine_fn(*args))


def test_prefix_end_bounds_exactly_the_keys_under_a_prefix():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_keys_ranges_and_create_once(etcd_server):
    async def body() -> None:
        client = EtcdClient([etcd_server.endpoint])
        try:
            for i in (3, 1, 2):
                await client.put(b"/t/%d" % i, b"v%d" % i)
            await client.put(b"/u/1", b"other prefix")
            entries, revision = await client.get_prefix(b"/t/")
            assert [(e.key, e.value) for e in entries] == [(b"/t/1", b"v1"), (b"/t/2", b"v2"), (b"/t/3", b"v3")]
            assert revision >= max(e.mod_revision for e in entries)
            newest, _ = await client.get_prefix(b"/t/", limit=1, descending=True, keys_only=True)
            assert [(e.key, e.value) for e in newest] == [(b"/t/3", b"")]
            assert await client.create(b"/t/once", b"first") is True
            assert await client.create(b"/t/once", b"second") is False
            assert await client.get(b"/t/once") == b"first"
            assert await client.delete_prefix(b"/t/") == 4
            assert await client.get(b"/t/1") is None
            assert await client.get(b"/u/1") == b"other prefix"
        finally:
            await client.close()

    run(body)


def test_a_key_on_a_lease_lives_while_renewed_and_goes_with_the_lease(etcd_server):
    async def body() -> None:
        client = EtcdClient([etcd_server.endpoint])
        try:
            lease = await client.grant_lease(5)
            await client.put(b"/n/me", b"", lease=lease)
            assert 0 < await client.keep_alive_once(lease) <= 5
            _, revision = await client.get_prefix(b"/n/")
            events = client.watch_prefix(b"/n/", revision + 1)
            await client.revoke(lease)
            event = await asyncio.wait_for(anext(events), 10)
            assert (event.kind, event.key) == ("delete", b"/n/me")
            assert await client.get(b"/n/me") is None
            assert await client.keep_alive_once(lease) <= 0, "a revoked lease is gone"
            await events.aclose()
        finally:
            await client.close()

    run(body)


def test_a_lease_left_unrenewed_expires_and_takes_its_keys(etcd_server):
    async def body() -> None:
        client = EtcdClient([etcd_server.endpoint])
        try:
            lease = await client.grant_lease(1)  # etcd raises it to its minimum, about 2 s
            revision = await client.put(b"/e/me", b"", lease=lease)
            events = client.watch_prefix(b"/e/", revision + 1)
            event = await asyncio.wait_for(anext(events), 15)  # the expiry, seen as it happens
            assert (event.kind, event.key) == ("delete", b"/e/me")
            assert await client.get(b"/e/me") is None
            assert await client.keep_alive_once(lease) <= 0, "an expired lease is gone"
            await events.aclose()
        finally:
            await client.close()

    run(body)


def test_a_watch_yields_puts_and_deletes_in_order_and_resumes_from_a_revision(etcd_server):
    async def body() -> None:
        client = EtcdClient([etcd_server.endpoint])
        try:
            first = await client.put(b"/w/a", b"1")
            await client.put(b"/w/b", b"2")
            await client.delete(b"/w/a")
            await client.put(b"/x/ignored", b"")
            events = client.watch_prefix(b"/w/", first)
            seen = [await asyncio.wait_for(anext(events), 10) for _ in range(3)]
            assert [(e.kind, e.key, e.value) for e in seen] == [
                ("put", b"/w/a", b"1"), ("put", b"/w/b", b"2"), ("delete", b"/w/a", b"")
            ]  # fmt: skip
            await events.aclose()
            resumed = client.watch_prefix(b"/w/", seen[1].mod_revision + 1)  # after a break: from the next one
            assert (await asyncio.wait_for(anext(resumed), 10)).kind == "delete"
            await resumed.aclose()
            await client.compact(seen[2].mod_revision)
            with pytest.raises(EtcdCompacted):
                await anext(client.watch_prefix(b"/w/", first))
        finally:
            await client.close()

    run(body)


def test_a_dead_endpoint_is_passed_over_and_no_answer_at_all_is_unavailable(etcd_server):
    async def body() -> None:
        dead = f"127.0.0.1:{free_port()}"
        client = EtcdClient([dead, etcd_server.endpoint], timeout_s=2.0)
        try:
            revision = await client.put(b"/f/1", b"ok")
            assert await client.get(b"/f/1") == b"ok"
            lease = await client.grant_lease(30)
            assert await client.keep_alive_once(lease) > 0
            events = client.watch_prefix(b"/f/", revision)
            assert (await asyncio.wait_for(anext(events), 10)).key == b"/f/1"  # the watch is up
            etcd_server.stop()
            with pytest.raises(EtcdUnavailable, match=etcd_server.endpoint):
                await asyncio.wait_for(anext(events), 10)
            with pytest.raises(EtcdUnavailable, match=dead):
                await client.get(b"/f/1")
            etcd_server.start()
            assert await client.get(b"/f/1") == b"ok", "the data outlived the restart"
            assert await client.keep_alive_once(lease) > 0, "the lease stream broken by the restart was opened again"
            etcd_server.stop()
            with pytest.raises(EtcdUnavailable, match=dead):
                await client.keep_alive_once(lease)
        finally:
            await client.close()

    run(body)


def test_tls_with_client_certificates(tmp_path):
    ca = CertificateAuthority(tmp_path / "ca")
    server_cert, server_key = ca.issue("etcd")
    client_cert, client_key = ca.issue("node")
    with EtcdServer(tmp_path / "etcd", tls=(server_cert, server_key, ca.ca_path)) as server:

        async def body() -> None:
            client = EtcdClient([server.endpoint], cert=str(client_cert), key=str(client_key), ca=str(ca.ca_path))
            try:
                await client.put(b"/tls/1", b"ok")
                assert await client.get(b"/tls/1") == b"ok"
            finally:
                await client.close()
            for refused in (
                EtcdClient([server.endpoint], ca=str(ca.ca_path), timeout_s=1.0),  # TLS without a client certificate
                EtcdClient([server.endpoint], timeout_s=1.0),  # plaintext
            ):
                try:
                    with pytest.raises(EtcdError, match=server.endpoint):
                        await refused.get(b"/tls/1")
                finally:
                    await refused.close()

        run(body)
