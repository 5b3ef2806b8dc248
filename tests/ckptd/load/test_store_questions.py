"""The load path's questions to the object store: never queued behind listings of a long history there, and a
store that fails is an answer of none, not an error that hides the other tiers."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from ckpt_core.errors import CheckpointError

from ckptd.keyed import SharedLocks
from ckptd.load.locate import Locator


def no_pins(job: str) -> frozenset[int]:
    """JobRetention.pinned where no step is pinned."""
    return frozenset()


def test_a_steps_question_is_answered_while_listings_that_timed_out_still_run() -> None:
    released = threading.Event()

    def long_listing() -> list[int]:  # a cold listing of thousands of steps, going on after its caller gave up
        released.wait()
        return []

    store = SimpleNamespace(is_complete=lambda job, step: step == 7)
    pools = [ThreadPoolExecutor(4), ThreadPoolExecutor(4), ThreadPoolExecutor(2), ThreadPoolExecutor(1)]
    rest = (lambda tier: None, *pools, no_pins, SharedLocks())
    locator = Locator(SimpleNamespace(), [], None, None, None, False, store, *rest)  # type: ignore[arg-type]

    async def ask() -> tuple[list, list[int] | None]:
        given_up = [await locator.ask_object_store(long_listing, timeout_s=0.05, listing=True) for _ in range(6)]
        return given_up, await locator.object_step("j", 7, timeout_s=5.0)

    try:
        given_up, answer = asyncio.run(ask())
    finally:
        released.set()
        for pool in pools:
            pool.shutdown()
    assert given_up == [None] * 6  # each listing's caller went on without it
    assert answer == [7], "the step's question waited behind the listings"


def test_a_store_that_fails_answers_none_and_a_warning(caplog) -> None:
    def down(*_: object) -> bool:
        raise CheckpointError("s3://bucket: connection refused")

    store = SimpleNamespace(is_complete=down, complete_steps=down)
    pools = [ThreadPoolExecutor(1) for _ in range(4)]
    rest = (lambda tier: None, *pools, no_pins, SharedLocks())
    locator = Locator(SimpleNamespace(), [], None, None, None, False, store, *rest)  # type: ignore[arg-type]

    async def ask() -> tuple[list[int] | None, list[int] | None]:
        return await locator.object_step("j", 7), await locator.object_steps("j")

    try:
        answers = asyncio.run(ask())
    finally:
        for pool in pools:
            pool.shutdown()
    assert answers == (None, None)
    assert [r.getMessage() for r in caplog.records].count("s3://bucket: connection refused") == 2


def test_a_refetch_with_peers_to_fetch_from_does_not_wait_on_the_store_first() -> None:
    asked: list[int] = []

    def is_complete(job: str, step: int) -> bool:
        asked.append(step)
        return True

    here = SimpleNamespace(complete_records=lambda job: {5: SimpleNamespace(line=())})  # a bad copy of step 5
    store = SimpleNamespace(is_complete=is_complete)
    pools = [ThreadPoolExecutor(1) for _ in range(4)]

    def known(peers: bool) -> set[int]:
        locator = Locator(
            SimpleNamespace(),
            [here],
            None,
            None,
            None,
            peers,
            store,
            *(lambda tier: None, *pools, no_pins, SharedLocks()),
        )  # type: ignore[arg-type]
        return asyncio.run(locator.known_steps("j", 5, refetch=True)).object_steps

    try:
        with_peers, without_peers = known(True), known(False)
    finally:
        for pool in pools:
            pool.shutdown()
    assert with_peers == set()  # locate fetches from a peer, and asks the store only if that fails
    assert without_peers == {5}
    assert asked == [5], "the refetch asked the store before the peers"
