"""Hand out shared-memory staging slots to training ranks and track what they hold.

Each (job, rank) owns at most two slots: one holds its newest snapshot (the
memory tier), the other receives the next save while the first is still being
flushed. A slot's state is kept beside it on disk (see slot_files), so a restarted
daemon knows which snapshots still need flushing.

The memory tier takes every save: a committed snapshot whose flush has not started
("pending") is replaced by a newer save of its rank when no other slot is free, and
its step is passed over on NVMe for that rank (reported by the Flusher). A slot
being flushed ("flushing", set by the Flusher's round on the event loop before the
bytes go to a flush thread) is never claimed, nor one whose step [nvme] flush_every
keeps; only then does a save wait ("block") or get skipped ("skip").

All methods run on the daemon's event loop thread, except record_hashed and write_markers (worker threads:
the markers carry the layout, megabytes to read and write). A slot's shared memory is allocated, and the
files of evicted slots unlinked, on the memory threads given at construction (Executors.slot_memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from ckpt_core.errors import CheckpointError, InvalidArgument, ReservationLost
from ckpt_core.format import MAX_SHARD_BYTES, ShardMeta, digest, layout_offset, round_up, seal, shown
from ckpt_core.history import Line, line_to_json
from ckpt_core.shard_key import ShardKey

from ckptd.save.rounds import kept
from ckptd.storage.durable_write import replace_file
from ckptd.storage.owned_dir import OWNER_ONLY, StagingAccess, claim_dir, create_new, open_owned
from ckptd.tiers.slot_files import SLOT_NAME, Slot, locked_by_a_writer, scan_slots, slot_path

log = logging.getLogger(__name__)

SLOTS_PER_RANK = 2
SLOT_GRANULE_BYTES = 1 << 20
DEFAULT_BUDGET_SHARE = 0.75  # of the staging filesystem (/dev/shm: RAM), with [staging] budget_bytes = 0


@dataclass(frozen=True)
class Reserved:
    """What reserve() found: a slot (None: skipped), the seconds waited, why, and the snapshot it replaced."""

    slot: Slot | None
    blocked_s: float
    reason: str
    replaced: ShardKey | None = None  # a committed snapshot whose flush had not started: passed over


@dataclass(frozen=True)
class Snapshot:
    """What a Commit says: which slot holds the whole snapshot of which shard, and how to read it."""

    key: ShardKey
    slot_path: str
    reservation: int
    data_size_bytes: int
    layout_json: str | bytes  # bytes as it came (UTF-8 text), decoded off the event loop
    run_id: str = ""
    layout_size_bytes: int = 0  # > 0: the layout lies in the slot at layout_offset(data_size_bytes), not in layout_json
    line: Line = ()  # the line of the job's history the step belongs to (SavePath.line_for)
    saved_at: str = ""  # when the daemon took the snapshot over (UTC, ISO 8601)


class SlotPool:
    """Allocate, reuse and bound the staging slots of one node."""

    def __init__(
        self,
        directory: Path,
        budget_bytes: int,
        policy: str,
        flush_every: int = 0,
        *,
        job_budget_bytes: int = 0,
        access: StagingAccess = OWNER_ONLY,
        memory_threads: Executor,
    ) -> None:
        """memory_threads: where slots' memory is allocated, gigabytes at a time (Executors.slot_memory)."""
        self.directory = directory
        self._memory_threads = memory_threads
        self.access = access  # [staging] group: the modes of job directories and slots
        self.budget_bytes = budget_bytes  # 0: none (tests of the pool alone); Node gives default_budget_bytes()
        self.job_budget_bytes = job_budget_bytes  # 0: none beyond budget_bytes
        self.policy = policy
        self.flush_every = flush_every  # [nvme] flush_every: a slot holding a step it keeps is never claimed
        self._slots: dict[tuple[str, int], list[Slot]] = {}
        self._changed = asyncio.Condition()
        self._reservations = time.time_ns()  # tokens never repeat across daemon restarts
        self._commits = 0
        self._evicted: list[Path] = []  # files of evicted slots, unlinked by the next allocation's thread
        self.last_saved: dict[str, float] = {}  # job -> time.monotonic() of its last commit (or of recovery)

    # -- queries ---------------------------------------------------------------

    def slots(self) -> list[Slot]:
        """Return every slot."""
        groups = list(self._slots.values())  # worker threads list them too (the memory tier) while the loop adds
        return [s for group in groups for s in list(group)]

    def last_saved_at(self, job: str, default: float) -> float:
        """Return the time.monotonic() of the job's last commit here (or of recovery); default if none."""
        return self.last_saved.get(job, default)

    def copies(self) -> list[Slot]:
        """Return a copy of every slot, for readers on other threads (the memory tier): the loop changes the slots."""
        return [dataclasses.replace(s) for s in self.slots()]

    def in_use_bytes(self) -> int:
        """Return the bytes of shared memory the slots take, or are being allocated to take."""
        return sum(max(s.size_bytes, s.allocating_bytes) for s in self.slots())

    def newest(self, job: str, rank: int) -> Slot | None:
        """Return the slot holding the rank's newest committed snapshot."""
        held = [s for s in self._slots.get((job, rank), []) if s.shard is not None and s.state != "writing"]
        return max(held, key=lambda s: (s.committed_seq, s.shard.step if s.shard else -1), default=None)

    # -- the save path -----------------------------------------------------------

    async def reserve(self, job: str, rank: int, size_bytes: int) -> Reserved:
        """Return a slot of at least size_bytes for the rank, the seconds waited and why.

        Under policy "block" this waits until a slot can be had (the reason then says what
        it waited for); under "skip" it answers no slot at once when none can. The slot's
        reservation token must come back with commit(). A snapshot replaced to make room is
        named in the answer: its flush had not started, and never will.
        """
        need = self._need(job, rank, size_bytes)
        blocked_s, waited_for = 0.0, ""
        async with self._changed:
            while True:
                self._abandon_unfinished(job, rank)
                slot, size_bytes, reason, replaced = self._take(job, rank, need)
                if slot is not None:
                    break
                if self.policy == "skip":
                    return Reserved(None, 0.0, reason)
                waited_for = waited_for or reason
                started = time.monotonic()
                await self._changed.wait()
                blocked_s += time.monotonic() - started
            self._reservations += 1
            slot.reservation = self._reservations
            group = self._slots.setdefault((job, rank), [])
            first_save = slot not in group
            if first_save:
                group.append(slot)
            slot.allocating_bytes = size_bytes  # counted against the budget while it is allocated
            spare = self._plan_spare(job, rank, size_bytes) if first_save else None
        # Allocating gigabytes of shared memory takes a while: off the event loop, and
        # without the pool's lock, so other ranks' saves and finished flushes go on.
        spare_done = asyncio.ensure_future(self._allocate_free(spare, size_bytes)) if spare else None
        loop = asyncio.get_running_loop()
        allocation = asyncio.ensure_future(loop.run_in_executor(self._memory_threads, self._hand_out, slot, size_bytes))
        # Counted against the budget until the thread is done, even if this call is cancelled.
        allocation.add_done_callback(lambda _: setattr(slot, "allocating_bytes", 0))
        try:
            await asyncio.shield(allocation)
        except CheckpointError:
            if spare_done is not None:
                await spare_done
            async with self._changed:
                for s in (slot, spare):  # drop what never got any memory
                    if s is not None and s in group and s.size_bytes == 0:
                        group.remove(s)
                self._changed.notify_all()
            raise
        if spare_done is not None:
            await spare_done  # the reply names the spare: it must be whole before the client maps it
        return Reserved(slot, blocked_s, waited_for or reason, replaced)

    async def prepare(self, job: str, rank: int, size_bytes: int) -> list[Slot]:
        """Allocate the rank's slots for saves of size_bytes ahead of its first save; return the slots to map.

        Called on the event loop (the Reserve RPC with prepare set). Up to SLOTS_PER_RANK
        slots, within the budget (sizes rounded up as reserve() does), each left free: no
        reservation is taken and no slot marked writing, so the rank's first save takes one
        of them. Idempotent: slots already large enough are left alone. It evicts only what
        a reserve would (free or settled slots of others, never a snapshot being flushed).
        The free slots come back largest first, the one the next save gets first, then the slot of the
        rank's newest snapshot where it fits (a restarted trainer's second save takes it): the client
        maps and pins it, which writes nothing.
        """
        need = self._need(job, rank, size_bytes)
        async with self._changed:
            await self._changed.wait_for(lambda: not any(s.state == "allocating" for s in self._group(job, rank)))
            group = self._group(job, rank)
            planned = [s for s in group if s.state == "free" and s.size_bytes < need]  # grown to fit
            planned = [s for s in planned if self._room_for(job, rank, need - s.size_bytes)]
            for slot in planned:
                slot.state, slot.allocating_bytes = "allocating", need
            while len(group) < SLOTS_PER_RANK and self._room_for(job, rank, need):
                slot = self._new_slot(job, rank, group, "allocating")
                slot.allocating_bytes = need
                group.append(slot)
                planned.append(slot)
            self.last_saved[job] = time.monotonic()  # idle release counts from here if no save follows
        await asyncio.gather(*(self._allocate_free(slot, need) for slot in planned))
        slots = self._reusable(job, rank)
        newest = self.newest(job, rank)
        if newest is not None and newest.size_bytes >= need and newest not in slots:
            slots.append(newest)
        return slots

    def _need(self, job: str, rank: int, size_bytes: int) -> int:
        """Return the slot size a shard of size_bytes needs, or refuse one that can never fit."""
        if not 0 <= size_bytes <= MAX_SHARD_BYTES:
            raise InvalidArgument(
                f"{job} rank {rank}: size_bytes {size_bytes} is out of range (0 to {MAX_SHARD_BYTES})"
            )
        need = round_up(max(size_bytes, 1), SLOT_GRANULE_BYTES)
        for key, budget in ("budget_bytes", self.budget_bytes), ("job_budget_bytes", self.job_budget_bytes):
            if budget and need > budget:
                raise InvalidArgument(f"a shard of {size_bytes} bytes cannot fit in staging.{key} = {budget}")
        fs = os.statvfs(self.directory)  # sized on demand, still no more than the filesystem holds
        if need > (capacity := fs.f_blocks * fs.f_frsize):
            raise InvalidArgument(f"a shard of {size_bytes} bytes cannot fit in {self.directory} ({capacity} bytes)")
        return need

    def _group(self, job: str, rank: int) -> list[Slot]:
        return self._slots.setdefault((job, rank), [])

    def _new_slot(self, job: str, rank: int, group: list[Slot], state: str) -> Slot:
        """Return a slot of no memory yet at the rank's lowest free index (the caller adds it to group)."""
        index = min(set(range(SLOTS_PER_RANK)) - {s.index for s in group})
        return Slot(slot_path(self.directory, job, rank, index), job, rank, index, 0, state)

    def _plan_spare(self, job: str, rank: int, size_bytes: int) -> Slot | None:
        # The rank's first save allocates its second slot too, so that the client can
        # map it in the background and its second save copies at full speed.
        group = self._slots[(job, rank)]
        if len(group) >= SLOTS_PER_RANK or not self._room_for(job, rank, size_bytes, evict=False):
            return None
        spare = self._new_slot(job, rank, group, "allocating")
        spare.allocating_bytes = size_bytes
        group.append(spare)
        return spare

    async def _allocate_free(self, slot: Slot, size_bytes: int) -> None:
        """Allocate (or grow) a slot nobody reserved, then leave it free: the spare, or a prepared one."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._memory_threads, self._hand_out, slot, size_bytes)
        except CheckpointError as e:
            log.warning("no staging slot ahead of need (spare or prepared) for %s rank %d: %s", slot.job, slot.rank, e)
        async with self._changed:
            slot.allocating_bytes = 0
            if slot.size_bytes == 0:
                self._slots[(slot.job, slot.rank)].remove(slot)
            else:
                slot.state = "free"
            self._changed.notify_all()

    def spare(self, job: str, rank: int) -> Slot | None:
        """Return a free slot of the rank that the next save will get, if one is allocated."""
        free = [s for s in self._reusable(job, rank) if s.state == "free" and s.size_bytes]
        return free[0] if free else None

    def commit(self, snapshot: Snapshot) -> Slot:
        """Record that a slot now holds a whole snapshot, all three steps below at once (tests, tools)."""
        slot = self.take(snapshot)
        try:
            layout_json = self.write_markers(slot, snapshot)
        except BaseException:
            self.abandon(slot)
            raise
        self.committed(slot, snapshot, layout_json)
        return slot

    def take(self, snapshot: Snapshot) -> Slot:
        """Check a Commit against the slot's reservation and hold the slot while its markers are written.

        Order of calls (the flusher's): take() on the event loop; write_markers() on a
        worker thread; then committed() on the event loop, or abandon() if writing failed.
        A slot being committed is neither reused nor abandoned by a reservation meanwhile.
        """
        key, slot_path, data_size_bytes = snapshot.key, snapshot.slot_path, snapshot.data_size_bytes
        slot = self._find(key.job, key.rank, slot_path)
        if slot is None:
            name = SLOT_NAME.fullmatch(Path(slot_path).name)
            if name and int(name[1]) == key.rank and Path(slot_path).parent == self.directory / key.job:
                raise ReservationLost(f"{key}: {slot_path} was dropped since it was reserved")
            raise InvalidArgument(f"{key}: {shown(slot_path)} is not a staging slot of this rank")
        if slot.state != "writing" or slot.reservation != snapshot.reservation:
            raise ReservationLost(f"{key}: {slot_path} is no longer reserved for this save")
        if not 0 <= data_size_bytes <= slot.size_bytes:
            raise InvalidArgument(f"{key}: data_size_bytes {data_size_bytes} does not fit the slot")
        at = layout_offset(data_size_bytes)
        if snapshot.layout_size_bytes and at + snapshot.layout_size_bytes > slot.size_bytes:
            raise InvalidArgument(
                f"{key}: a layout of {snapshot.layout_size_bytes} bytes at {at} does not fit the slot"
            )
        self._commits = max(self._commits + 1, time.time_ns())  # ordered across daemon restarts too
        slot.committed_seq, slot.state = self._commits, "committing"
        return slot

    def write_markers(self, slot: Slot, snapshot: Snapshot) -> str:
        """Write the markers a restart recovers the snapshot from; return its layout (a worker thread)."""
        try:
            layout = snapshot.layout_json
            if snapshot.layout_size_bytes:
                layout = _layout_in_slot(slot, snapshot.data_size_bytes, snapshot.layout_size_bytes)
            elif isinstance(layout, str):
                layout = layout.encode()
            layout_json = _text(layout, str(snapshot.key))
            # The layout (megabytes for a large model) goes beside the marker as it came: never escaped into JSON.
            replace_file(slot.layout_path, layout, StagingAccess.MARKER_MODE, durable=False)
            record = {
                "shard": snapshot.key.__dict__,
                "data_size_bytes": snapshot.data_size_bytes,
                "layout_xxh3_128": digest(layout),
                "run_id": snapshot.run_id,
                "line": line_to_json(snapshot.line),
                "saved_at": snapshot.saved_at,
                "committed_ns": slot.committed_seq,
            }
            replace_file(slot.pending_path, seal(record), StagingAccess.MARKER_MODE, durable=False)
        except BaseException:
            for path in (slot.pending_path, slot.layout_path):  # nothing half-written names the slot
                path.unlink(missing_ok=True)
            raise
        return layout_json

    def committed(self, slot: Slot, snapshot: Snapshot, layout_json: str) -> None:
        """Make the slot hold the snapshot, pending: flushed by a round of its job, unless a newer one replaces it."""
        slot.shard, slot.data_size_bytes, slot.meta = snapshot.key, snapshot.data_size_bytes, None
        slot.layout_json, slot.run_id, slot.state = layout_json, snapshot.run_id, "pending"
        slot.line, slot.saved_at = snapshot.line, snapshot.saved_at
        slot.committed_at_s = self.last_saved[slot.job] = time.monotonic()

    def abandon(self, slot: Slot) -> None:
        """Give up a slot whose markers could not be written: it holds nothing worth keeping (event loop)."""
        slot.state = "free"

    def record_hashed(self, slot: Slot, meta: ShardMeta) -> None:
        """Record a slot's checksums: from now on the memory tier serves it. Any thread."""
        replace_file(slot.meta_path, meta.to_bytes(), StagingAccess.MARKER_MODE, durable=False)
        slot.meta = meta

    def start_flush(self, slot: Slot) -> None:
        """Pin a pending slot for its flush round: no save claims it from now on (event loop, before any await)."""
        slot.state = "flushing"

    def pass_over(self, slot: Slot) -> None:
        """Drop a pending snapshot that will never be flushed, its markers first (event loop; changed() follows).

        Without its commit marker a restarted daemon finds the slot empty: recovery never writes it.
        """
        slot.pending_path.unlink(missing_ok=True)
        slot.layout_path.unlink(missing_ok=True)
        slot.meta_path.unlink(missing_ok=True)
        slot.shard, slot.meta, slot.layout_json, slot.state = None, None, "", "free"

    async def changed(self) -> None:
        """Wake the saves waiting for a slot: some were freed (passed over)."""
        async with self._changed:
            self._changed.notify_all()

    async def settle(self, slot: Slot) -> None:
        """Mark a slot's flush finished (durable or failed): it may be reused once not newest."""
        async with self._changed:
            slot.state = "settled"
            self._changed.notify_all()

    def drop_step(self, job: str, step: int, dry_run: bool = False) -> list[Slot]:
        """Drop the settled snapshots of a step (`ckptd rm`) and return their slots (event loop; changed() follows).

        Only settled ones: a snapshot still to be flushed belongs to a save under way (its step is busy,
        and rm refuses it). The slots stay, free for the rank's next saves.
        """
        held = [s for s in self.slots() if s.job == job and s.shard and s.shard.step == step and s.state == "settled"]
        if not dry_run:
            for slot in held:
                self.pass_over(slot)
        return held

    def drop_job(self, job: str) -> list[Slot]:
        """Forget every slot of a job and return them, for the caller to unlink (event loop)."""
        dropped = [s for key in [k for k in self._slots if k[0] == job] for s in self._slots.pop(key)]
        self.last_saved.pop(job, None)
        return dropped

    # -- recovery ------------------------------------------------------------------

    def recover(self) -> list[Slot]:
        """Load the slots found on disk; return those holding a snapshot not yet settled.

        Raises UnsafePath where the directory could have been prepared by another user (the daemon's
        start-up checked it already, in root_identity.claim).
        """
        access = self.access
        claim_dir(self.directory, access.dir_mode, "the staging directory", "staging.dir", gid=access.gid)
        held = []
        for slot in scan_slots(self.directory):
            self._slots.setdefault((slot.job, slot.rank), []).append(slot)
            self.last_saved[slot.job] = time.monotonic()
            if slot.shard is not None:
                slot.state, slot.committed_at_s = "pending", time.monotonic()
                held.append(slot)
        return held

    # -- internals -------------------------------------------------------------------

    def _find(self, job: str, rank: int, path: str) -> Slot | None:
        return next((s for s in self._slots.get((job, rank), []) if str(s.path) == path), None)

    def _abandon_unfinished(self, job: str, rank: int) -> None:
        # A rank saves one snapshot at a time: a slot it reserved and never committed
        # belongs to a save that died half-way, unless a live process still holds the
        # slot's lock, which means two processes claim the same job and rank.
        for slot in self._slots.get((job, rank), []):
            if slot.state != "writing":
                continue
            if locked_by_a_writer(slot.path):
                raise InvalidArgument(
                    f"job {job} rank {rank} is being saved by another live process; "
                    "each rank of a job must be one process (check CKPT_JOB, RANK and WORLD_SIZE)"
                )
            slot.state = "free"

    def _reusable(self, job: str, rank: int) -> list[Slot]:
        """Return the rank's slots that may be overwritten without touching its newest snapshot, largest first."""
        newest = self.newest(job, rank)
        free = [s for s in self._slots.get((job, rank), []) if s.state in ("free", "settled") and s is not newest]
        return sorted(free, key=lambda s: s.size_bytes, reverse=True)

    def _take(self, job: str, rank: int, need: int) -> tuple[Slot | None, int, str, ShardKey | None]:
        """Pick a slot for the rank and the size to give it, or say why there is none.

        In order: a spare slot that fits, a new slot, a spare slot grown; then the slot of
        the newest snapshot (the memory tier's copy), once it is settled; then a snapshot
        whose flush has not started (newest wins: an older one before the newest), which
        the answer names as replaced.
        """
        group = self._group(job, rank)
        spare = self._reusable(job, rank)
        if spare and spare[0].size_bytes >= need:
            return self._claim(spare[0]), spare[0].size_bytes, "", None
        if len(group) < SLOTS_PER_RANK and self._room_for(job, rank, need):
            return self._new_slot(job, rank, group, "writing"), need, "new slot", None
        newest = self.newest(job, rank)
        last_resort = [newest] if newest is not None and newest.state == "settled" else []
        unflushed = [s for s in group if s.state == "pending" and s.shard and not kept(s.shard.step, self.flush_every)]
        unflushed.sort(key=lambda s: (s is newest, s.committed_seq))
        for slot in spare + last_resort + unflushed:
            replaced = slot.shard if slot.state == "pending" else None
            if slot.size_bytes >= need:
                return self._claim(slot), slot.size_bytes, "", replaced
            if self._room_for(job, rank, need - slot.size_bytes):
                return self._claim(slot), need, "grew a slot", replaced
        if spare or last_resort or unflushed or len(group) < SLOTS_PER_RANK:
            if self._over_job_budget(job, need):
                why = f"{job}'s share, staging.job_budget_bytes ({self.job_budget_bytes}), is taken by its snapshots"
                return None, 0, why + " still being flushed", None
            return (
                None,
                0,
                f"staging.budget_bytes ({self.budget_bytes}) is taken by snapshots still being flushed",
                None,
            )
        return None, 0, self._why_both_busy(job, rank, group), None

    def _why_both_busy(self, job: str, rank: int, group: list[Slot]) -> str:
        """Say what a save of a rank whose slots are all in use waits for."""
        if any(s.state == "allocating" for s in group):
            return f"the staging slots of {job} rank {rank} are being allocated"
        flushing = sorted(s.shard.step for s in group if s.shard and s.state == "flushing")
        if not flushing:
            return f"both staging slots of {job} rank {rank} hold snapshots still being flushed"
        why = (
            f"waits for the NVMe flush of {job} step {flushing[0]}: "
            f"both staging slots of rank {rank} hold snapshots that must be flushed"
        )
        kept_steps = sorted(s.shard.step for s in group if s.shard and s.state == "pending")  # else claimable
        if kept_steps:
            why += f" (step {kept_steps[0]} is kept by [nvme] flush_every = {self.flush_every})"
        return why

    def _claim(self, slot: Slot) -> Slot:
        slot.meta_path.unlink(missing_ok=True)  # the old snapshot stops being served before it is overwritten
        slot.pending_path.unlink(missing_ok=True)
        slot.layout_path.unlink(missing_ok=True)
        slot.shard, slot.meta, slot.layout_json, slot.state = None, None, "", "writing"
        return slot

    def _room_for(self, job: str, rank: int, extra_bytes: int, evict: bool = True) -> bool:
        if self._over_job_budget(job, extra_bytes):
            return False  # evicting other jobs' slots would not help
        if not self.budget_bytes:
            return True
        over = self.in_use_bytes() + extra_bytes - self.budget_bytes
        if over > 0 and evict:
            self._evict_others(job, rank, over)
        return self.in_use_bytes() + extra_bytes <= self.budget_bytes

    def _over_job_budget(self, job: str, extra_bytes: int) -> bool:
        """Return whether extra_bytes more for the job's slots would pass staging.job_budget_bytes."""
        if not self.job_budget_bytes:
            return False
        held = sum(
            max(s.size_bytes, s.allocating_bytes) for (j, _), group in self._slots.items() if j == job for s in group
        )
        return held + extra_bytes > self.job_budget_bytes

    def _evict_others(self, job: str, rank: int, want_bytes: int) -> None:
        for (other_job, other_rank), group in self._slots.items():
            if (other_job, other_rank) == (job, rank):
                continue
            for slot in self._reusable(other_job, other_rank):
                if want_bytes <= 0:
                    return
                want_bytes -= slot.size_bytes
                group.remove(slot)
                # Unlinked by the allocation that follows, on its thread: freeing gigabytes takes a while.
                self._evicted += [slot.path, slot.meta_path, slot.pending_path, slot.layout_path]

    def _hand_out(self, slot: Slot, size_bytes: int) -> None:
        """Make the slot's file size_bytes long, its memory allocated. Runs on a worker thread."""
        with contextlib.suppress(IndexError):  # another allocation's thread may take the last one
            while self._evicted:  # the memory of slots evicted to make room goes first
                self._evicted.pop().unlink(missing_ok=True)
        if size_bytes == slot.size_bytes and slot.path.exists():
            return
        try:
            fd = self._open_slot(slot)
            try:
                os.ftruncate(fd, size_bytes)
                os.posix_fallocate(fd, 0, size_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            slot.state = "free"
            if slot.size_bytes == 0:
                slot.path.unlink(missing_ok=True)
            raise CheckpointError(f"cannot allocate {size_bytes} bytes of staging memory in {slot.path}: {e}") from e
        slot.size_bytes = size_bytes

    def _open_slot(self, slot: Slot) -> int:
        """Open a slot's file to size it: this daemon's own (never through a link), made anew for a new slot."""
        if slot.size_bytes:
            with contextlib.suppress(FileNotFoundError):  # removed under the daemon: made anew below
                return open_owned(slot.path, os.O_RDWR)
        access = self.access
        claim_dir(slot.path.parent, access.dir_mode, "a job's staging directory", "staging.dir", gid=access.gid)
        slot.path.unlink(missing_ok=True)  # a file left by a slot evicted or given back: never written through
        return create_new(slot.path, access.slot_mode, os.O_RDWR, access.gid)  # the training ranks map it


def default_budget_bytes(directory: Path) -> int:
    """Return the staging budget of [staging] budget_bytes = 0: a share of the filesystem the directory is on.

    Node calls it at start, before the directory exists: the nearest directory above that does is measured.
    Bounded by default, so that no job (nor a member of the daemon's group) fills /dev/shm, which is RAM.
    """
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fs = os.statvfs(existing)
    share = int(fs.f_blocks * fs.f_frsize * DEFAULT_BUDGET_SHARE)
    return max(SLOT_GRANULE_BYTES, share - share % SLOT_GRANULE_BYTES)  # whole granules, as slots are sized


def _text(layout: bytes, what: str) -> str:
    try:
        return layout.decode()
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what}: layout is not UTF-8 text") from None


def _layout_in_slot(slot: Slot, data_size_bytes: int, size_bytes: int) -> bytes:
    """Read a layout the client wrote into its slot after the data (a worker thread)."""
    with open(slot.path, "rb", buffering=0) as f:
        return os.pread(f.fileno(), size_bytes, layout_offset(data_size_bytes))
