"""Durable writes survive every short write and every EINVAL that O_DIRECT can answer, at any position.

The filesystem's answers are injected: os.open takes O_DIRECT everywhere (the flag is
dropped, and the descriptor remembered as direct), and os.pwrite on a direct
descriptor writes fewer bytes than asked, or refuses with EINVAL, at a chosen call.
What lands in the file must be the bytes asked for, whichever path wrote them.
"""

from __future__ import annotations

import asyncio
import errno
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.byte_range import ByteRange
from ckpt_core.format import ShardMeta, chunk_ranges, digest

from ckptd.replication.receiving import ReplicaReceiver
from ckptd.storage.durable_write import RangeWriter
from ckptd.tiers.replica_store import ReplicaStore

CHUNK = 1 << 20
SIZE = 3 * CHUNK + 5000  # the last block is not 4 KiB aligned: padding goes past the end and is cut off


class FlakyDirectIO:
    """Answer the n-th direct pwrite short (short_bytes), then refuse the next with EINVAL (or not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at_call: int, short_bytes: int, einval_after: bool) -> None:
        self.direct: set[int] = set()
        self.calls = 0
        self.at_call, self.short_bytes, self.einval_after = at_call, short_bytes, einval_after
        self.refused = False
        real_open, real_pwrite = os.open, os.pwrite

        def fake_open(path, flags, *args, **kwargs):
            fd = real_open(path, flags & ~os.O_DIRECT, *args, **kwargs)
            if flags & os.O_DIRECT:
                self.direct.add(fd)
            else:
                self.direct.discard(fd)
            return fd

        def fake_pwrite(fd, data, offset):
            if fd not in self.direct:
                return real_pwrite(fd, data, offset)
            self.calls += 1
            if offset % 4096 or len(data) % 4096:  # as the kernel answers a direct write that is not aligned
                self.refused = True
                raise OSError(errno.EINVAL, "Invalid argument")
            if self.calls == self.at_call:
                return real_pwrite(fd, memoryview(data)[: min(self.short_bytes, len(data))], offset)
            if self.calls == self.at_call + 1 and self.einval_after:
                self.refused = True
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "pwrite", fake_pwrite)


FAULTS = [
    (at_call, short_bytes, einval_after)
    for at_call in (1, 2, 3)
    for short_bytes in (1, 4096, 5000, CHUNK - 4096)
    for einval_after in (True, False)
]


@pytest.mark.parametrize(("at_call", "short_bytes", "einval_after"), FAULTS)
def test_range_writer_writes_exactly_the_bytes_asked(tmp_path, monkeypatch, at_call, short_bytes, einval_after):
    data = os.urandom(SIZE)
    padded = bytearray(data) + bytearray(-SIZE % 4096)
    FlakyDirectIO(monkeypatch, at_call, short_bytes, einval_after)
    writer = RangeWriter(tmp_path / "f")
    try:
        for offset, length in chunk_ranges(SIZE, CHUNK):
            writer.write_range(memoryview(padded)[offset:], offset, length)
        writer.finish(SIZE)
    finally:
        writer.close()
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize(("at_call", "short_bytes", "einval_after"), [f for f in FAULTS if f[0] == 1])
def test_a_replica_written_after_a_refused_direct_write_is_the_sent_bytes(
    tmp_path, monkeypatch, at_call, short_bytes, einval_after
):
    data = os.urandom(SIZE)
    digests = tuple(digest(data[o : o + n]) for o, n in chunk_ranges(SIZE, CHUNK))
    meta = ShardMeta("j", 3, 0, 1, SIZE, CHUNK, digests, "{}", "run")
    faults = FlakyDirectIO(monkeypatch, at_call, short_bytes, einval_after)
    tier = ReplicaStore(tmp_path / "peer")

    async def pieces():
        for o in range(0, SIZE, 300_000):
            yield memoryview(data[o : o + 300_000])

    # The receiver writes in blocks of 8 MiB: the whole shard is its first direct write.
    async def body(receiver: ReplicaReceiver) -> None:
        await receiver.receive_range(meta, "ab" * 8, ByteRange(0, SIZE), pieces())
        await receiver.seal(meta, "ab" * 8)

    with ThreadPoolExecutor(4) as threads, ThreadPoolExecutor(4) as receiving:
        asyncio.run(body(ReplicaReceiver(tier, threads, receiving)))
    assert faults.calls >= at_call  # the fault was reached
    assert faults.refused or not einval_after  # refused as asked (or, after an unaligned short write, anyway)
    assert ((tier.root / "j" / "3") / "rank-00000.data").read_bytes() == data
