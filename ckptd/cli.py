"""The ckptd command: serve, status, ls, inspect, restore, verify, gc, pin, unpin, rm, export, import.

Exit codes: 0 success, 1 failure (not found, verification failed, daemon
error), 2 usage or config error. Output to a pipe whose reader left goes to /dev/null:
the command runs to its end, quietly, and exits with its own status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, cast

from ckpt.transport import DaemonClient
from ckpt_core.errors import CheckpointError, DaemonUnavailable, InvalidArgument
from ckpt_core.format import counted, validate_job, validate_step
from ckpt_core.wire.v1 import ckptd_pb2 as pb

from ckptd import __version__
from ckptd.config import Config, ConfigError, load_config
from ckptd.offline import export, ingest
from ckptd.operations.status_table import human_age, human_size, status_lines

EXAMPLES = """\
examples:
  ckptd serve --config /etc/ckptd/ckptd.toml
  ckptd ls --job llama-7b
  ckptd restore --job llama-7b --step latest --from auto --to /mnt/restore
  ckptd restore --job llama-7b --from peer --to /mnt/restore   # this node's disk is gone
  ckptd restore --job llama-7b --from s3://ckpts/prod --to /mnt/restore   # nothing left but the bucket
  ckptd verify --job llama-7b --tier object
  ckptd verify --job llama-7b --step 1200
  ckptd gc --dry-run
  ckptd pin --job llama-7b --step 1200
  ckptd rm --job llama-7b --step 1100
  ckptd export --job llama-7b --format dcp --to /mnt/export/llama-7b-dcp
  ckptd import --job llama-7b --step 1200 --dcp /mnt/ckpt/llama-7b/step-1200
"""


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", metavar="PATH", help="TOML config file (default: $CKPTD_CONFIG, else built-in defaults)"
    )
    daemon = argparse.ArgumentParser(add_help=False)
    daemon.add_argument(
        "--address", help="the daemon's socket path or unix:PATH (default: $CKPTD_ADDRESS, else the configured socket)"
    )

    p = argparse.ArgumentParser(
        prog="ckptd",
        description="Asynchronous multilevel checkpointing daemon for PyTorch training.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = functools.partial(sub.add_parser, formatter_class=argparse.RawDescriptionHelpFormatter)

    s = command(
        "serve",
        parents=[common],
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground. SIGTERM or SIGINT drains in-flight work, then exits 0.",
    )
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    s.add_argument(
        "--log-json",
        action="store_true",
        help='log one JSON object per line: {"time", "level", "logger", "message"} (and "exception")',
    )
    s.add_argument("--root", help="override [node] root: this node's NVMe tier")
    s.add_argument("--socket", help="override [node] socket: the unix socket for local clients")
    s.add_argument("--staging-dir", help="override [staging] dir: where the shared-memory slots live")

    s = command(
        "status",
        parents=[common, daemon],
        help="show the running daemon's state",
        epilog=_examples("ckptd status", "ckptd status --json | jq .tiers.object"),
    )
    s.add_argument("--json", action="store_true", help="print one JSON document")

    s = command(
        "ls",
        parents=[common, daemon],
        help="list complete steps and the tiers holding them",
        epilog=_examples("ckptd ls", "ckptd ls --job llama-7b --json"),
    )
    s.add_argument("--job", help="only this job")
    s.add_argument("--json", action="store_true", help="print one JSON list")

    s = command(
        "restore",
        parents=[common],
        help="copy a step out of a tier into a directory (no daemon needed)",
        description="Copy every shard of a step, verified, into DIR/<job>/<step>/, readable by ckpt.load_local.",
        epilog=_examples(
            "ckptd restore --job llama-7b --to /mnt/restore                      # latest, fastest good copy",
            "ckptd restore --job llama-7b --step 1200 --from peer --to /mnt/restore",
            "ckptd restore --job llama-7b --from s3://ckpts/prod --to /mnt/restore  # nothing left but the bucket",
        ),
    )
    s.add_argument("--job", required=True, help="the job to restore")
    s.add_argument("--step", default="latest", help="a step number, or latest (default)")
    s.add_argument(
        "--from",
        dest="source",
        default="auto",
        help="auto (fastest good copy), memory, nvme, peer (this node's replicas and the other nodes "
        "in [peer] addresses), object ([object] url), or an object-store URL such as s3://bucket/prefix "
        "(read with [object] storage_options; no daemon and no other tier needed)",
    )
    s.add_argument("--to", required=True, metavar="DIR", type=Path)
    s.add_argument("--json", action="store_true", help='print {"job", "step", "dir"} when done')

    s = command(
        "verify",
        parents=[common],
        help="check every byte of a job's steps against their checksums",
        epilog=_examples(
            "ckptd verify --job llama-7b                       # every complete step, every tier",
            "ckptd verify --job llama-7b --step 1200 --tier object",
        ),
    )
    s.add_argument("--json", action="store_true", help="print one JSON list of checks instead of lines")
    s.add_argument("--job", required=True, help="the job to check")
    s.add_argument("--step", type=int, help="only this step (default: every complete step)")
    s.add_argument(
        "--tier", help="only this tier: memory, nvme, peer, object or an object-store URL (default: every tier)"
    )

    s = command(
        "inspect",
        parents=[common],
        help="list a step's tensors: keys, dtypes, shapes, bytes and the ranks holding them (no torch needed)",
        epilog=_examples(
            "ckptd inspect --job llama-7b --step 1200",
            "ckptd inspect --job llama-7b --json --tier object   # the latest step complete in the store",
        ),
    )
    s.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    s.add_argument("--job", required=True, help="the job")
    s.add_argument("--step", default="latest", help="a complete step's number, or latest (default)")
    s.add_argument(
        "--tier", help="read this tier: memory, nvme, peer, object or an object-store URL (default: the fastest)"
    )

    s = command(
        "gc",
        parents=[common, daemon],
        help="apply retention now",
        epilog=_examples(
            "ckptd gc --dry-run    # what would go, and why",
            "ckptd gc",
            "ckptd gc --job old-run --all [--tier object]   # a finished job: its slots, steps, replicas",
        ),
    )
    s.add_argument("--json", action="store_true", help="print one JSON list of removals")
    s.add_argument("--dry-run", action="store_true", help="show what would be removed and why, remove nothing")
    s.add_argument("--job", help="only this job")
    s.add_argument("--all", action="store_true", help="with --job: remove the finished job from this node entirely")
    s.add_argument("--tier", choices=("object",), help="with --all: its steps in the object store too")

    for name, verb in (("pin", "pin"), ("unpin", "unpin")):
        s = command(
            name,
            parents=[common, daemon],
            help="keep a step from retention on this node"
            if name == "pin"
            else "give a pinned step back to retention on this node",
            description=(
                "Pin a step complete on some tier of this node: retention never removes it from any tier of "
                "this node, whatever [retention] keeps. Pins persist across restarts (under the node root)."
                if name == "pin"
                else "Unpin a step: retention treats it as any other step from its next pass "
                "(after the job's next save, or `ckptd gc`)."
            ),
            epilog=_examples(f"ckptd {verb} --job llama-7b --step 1200"),
        )
        s.add_argument("--job", required=True, help="the job")
        s.add_argument("--step", type=int, required=True, help="the step")
        s.add_argument("--json", action="store_true", help='print {"job", "pinned": [steps]}')

    s = command(
        "rm",
        parents=[common, daemon],
        help="remove one step from this node's tiers (--tier object: the shared object store too)",
        description=(
            "Remove one step from every tier of this node: NVMe, the replicas other nodes sent here, and its "
            "settled staging slots; with --tier object, from the object store too, which every node shares "
            "(without it the store is left alone, as by gc). It prints one line per tier it removes the step "
            "from. Refused for the job's head (the newest step of its line) unless --force, for a pinned step "
            "unless --force, and for a step being written, replicated, uploaded or read (try again later). "
            "Other nodes' copies stay.\n\n"
            "exit codes: 0 removed, 1 not found or refused, 2 usage"
        ),
        epilog=_examples(
            "ckptd rm --job llama-7b --step 1100 --dry-run",
            "ckptd rm --job llama-7b --step 1200 --force   # the job's head: its latest step goes back to 1100",
            "ckptd rm --job llama-7b --step 900 --tier object   # the shared object store's copy too",
        ),
    )
    s.add_argument("--job", required=True, help="the job")
    s.add_argument("--step", type=int, required=True, help="the step to remove")
    s.add_argument("--force", action="store_true", help="remove it even if it is the job's head or pinned")
    s.add_argument(
        "--tier", choices=("object",), help="the shared object store's copy too (every node's, not this one's)"
    )
    s.add_argument("--dry-run", action="store_true", help="show what would be removed, remove nothing")
    s.add_argument("--json", action="store_true", help="print one JSON list of removals")
    export.add_parser(command, common)
    ingest.add_parser(command, common, daemon)
    return p


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def main(argv: list[str] | None = None) -> int:
    """Run one ckptd command and return its exit code."""
    args = _parser().parse_args(argv)
    flags = {}
    if args.command == "serve":
        flags = {"node": {"root": args.root, "socket": args.socket}, "staging": {"dir": args.staging_dir}}
    try:
        config = load_config(args.config, flags=flags)
    except ConfigError as e:
        print(f"ckptd: config error: {e}", file=sys.stderr)
        return 2
    with _stdout_outliving_its_reader():
        try:
            return COMMANDS[args.command](args, config)
        except ConfigError as e:  # found only when used: node.cpus the daemon's cpuset does not have
            print(f"ckptd: config error: {e}", file=sys.stderr)
            return 2
        except InvalidArgument as e:
            print(f"ckptd: {e}", file=sys.stderr)
            return 2
        except (CheckpointError, OSError) as e:
            print(f"ckptd: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130


class _OutlivingItsReader:
    """Stand in for sys.stdout: once whoever reads it has gone (`ckptd verify ... | head -1`), it is /dev/null.

    Python's docs' way with a closed pipe (stdout pointed at /dev/null, so that no flush fails
    again), taken where the write fails: the command runs on to its end and exits with its own
    status (for verify, 1 still means a bad byte, never a reader that stopped reading).
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what is still buffered goes there at the next flush
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _stdout_outliving_its_reader() -> Iterator[None]:
    """Run a command with sys.stdout an _OutlivingItsReader, flushed through it at the end, not at exit."""
    stream = sys.stdout
    sys.stdout = cast(TextIO, _OutlivingItsReader(stream))
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = stream


class JsonLogFormatter(logging.Formatter):
    """Format each record as one JSON object on one line (for journald and log shippers)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line)


def _progress() -> Callable[[str], None]:
    """Return where restore reports on each rank: a line each, or on a terminal one line redrawn in place."""
    if not sys.stderr.isatty():
        return lambda line: print(line, file=sys.stderr)

    def redraw(line: str) -> None:
        width = shutil.get_terminal_size().columns - 1
        keep = "trying the next tier" in line  # a failure stays on screen
        print(f"\r{line[:width]:<{width}}", end="\n" if keep else "", file=sys.stderr, flush=True)

    return redraw


def _client(args: argparse.Namespace, config: Config) -> DaemonClient:
    """Return a client of the daemon named by --address, else $CKPTD_ADDRESS, else the configured socket."""
    return DaemonClient(args.address or os.environ.get("CKPTD_ADDRESS") or str(config.socket_path))


def cmd_serve(args: argparse.Namespace, config: Config) -> int:
    from ckptd.daemon import AlreadyServing, ListenFailed, RootGone, serve
    from ckptd.operations.root_lock import RootInUse
    from ckptd.storage.owned_dir import UnsafePath

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLogFormatter() if args.log_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=args.log_level, handlers=[handler])
    logging.captureWarnings(True)  # Python's warnings go through the same formatter
    try:
        asyncio.run(serve(config))
    except RootGone as e:
        print(f"ckptd: {e}", file=sys.stderr)
        return 1
    except (AlreadyServing, ListenFailed, RootInUse, UnsafePath) as e:  # the config names what another holds
        print(f"ckptd: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    doc = json.loads(_client(args, config).call("Status", pb.StatusRequest()).json)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print("\n".join(status_lines(doc)))
    return 0


MIXED = "(mixed: each rank has a copy, no single tier has all)"


def cmd_ls(args: argparse.Namespace, config: Config) -> int:
    job = validate_job(args.job) if args.job else ""
    try:
        found = _client(args, config).call("List", pb.ListRequest(job=job)).steps
    except DaemonUnavailable as e:
        if args.address or os.environ.get("CKPTD_ADDRESS"):
            raise  # asked about a particular daemon: this node's disks are no answer
        from ckptd.offline.restore import readable_tiers, tool_threads
        from ckptd.tiers.catalog import list_steps

        print(f"ckptd: {e}\nckptd: listing what this node's own tiers hold instead", file=sys.stderr)
        with tool_threads() as threads:
            found = list_steps(readable_tiers(config, "auto", threads), job)
    steps = [
        {
            "job": s.job,
            "step": s.step,
            "world_size": s.world_size,
            "size_bytes": s.size_bytes,
            "tiers": list(s.tiers),
            "committed_at": s.committed_at or None,
            "superseded": s.superseded,
            "pinned": s.pinned,
        }
        for s in found
    ]
    if args.json:
        print(json.dumps(steps))
        return 0
    if not steps:
        print("no complete steps")
        return 0
    width = max(len("JOB"), *(len(s["job"]) for s in steps))
    print(f"{'JOB':<{width}}  {'STEP':>10}  {'RANKS':>5}  {'SIZE':>10}  {'COMMITTED (UTC)':<19}  {'AGE':>7}  TIERS")
    now = time.time()
    for s in steps:
        size = human_size(s["size_bytes"])
        tiers = ",".join(s["tiers"]) or MIXED
        when, age = _committed(s["committed_at"], now)
        superseded = ("  superseded" if s["superseded"] else "") + ("  pinned" if s["pinned"] else "")
        print(f"{s['job']:<{width}}  {s['step']:>10}  {s['world_size']:>5}  {size:>10}  {when:<19}  {age:>7}  "
              f"{tiers}{superseded}")  # fmt: skip
    return 0


def _committed(committed_at: str | None, now: float) -> tuple[str, str]:
    """Return ls's commit time (to the second) and age of a step; "-" for a step saved before records had it."""
    if not committed_at:
        return "-", "-"
    moment = datetime.datetime.fromisoformat(committed_at)
    return moment.strftime("%Y-%m-%d %H:%M:%S"), human_age(now - moment.timestamp())


def cmd_restore(args: argparse.Namespace, config: Config) -> int:
    from ckptd.offline.restore import latest_step, readable_tiers, restore, tool_threads

    job = validate_job(args.job)
    with tool_threads() as threads:
        tiers = readable_tiers(config, args.source, threads)
        step = latest_step(tiers, job) if args.step == "latest" else _parse_step(args.step)
        try:
            step_dir = restore(tiers, job, step, args.to, _progress(), threads.nvme_writes)
        finally:
            if sys.stderr.isatty():
                print(file=sys.stderr)  # end the line redrawn in place
    print(json.dumps({"job": job, "step": step, "dir": str(step_dir)}) if args.json else step_dir)
    return 0


def cmd_inspect(args: argparse.Namespace, config: Config) -> int:
    from ckptd.offline.inspect import inspect_step
    from ckptd.offline.restore import latest_step, readable_tiers, tool_threads

    job = validate_job(args.job)
    step = None if args.step == "latest" else _parse_step(args.step)
    with tool_threads() as threads:
        tiers = readable_tiers(config, args.tier or "auto", threads)
        found = inspect_step(tiers, job, latest_step(tiers, job) if step is None else step)
    if args.json:
        print(json.dumps(found.to_json()))
        return 0
    ranks = counted(found.world_size, "rank")
    print(f"{found.job} step {found.step}: {ranks}, {human_size(found.size_bytes)}, read from tier {found.tier}")
    width = max((len(row.key) for row in found.tensors), default=3)
    print(f"{'key':<{width}}  {'dtype':<9}  {'shape':<18}  {'bytes':>10}  ranks")
    for row in found.tensors:
        shape = "x".join(map(str, row.shape)) or "()"
        ranks = ",".join(map(str, row.ranks)) if len(row.ranks) < 9 else f"{len(row.ranks)} ranks"
        kind = " (sharded)" if row.kind == "sharded" else ""
        print(f"{row.key:<{width}}  {row.dtype:<9}  {shape:<18}  {human_size(row.size_bytes):>10}  {ranks}{kind}")
    return 0


def cmd_verify(args: argparse.Namespace, config: Config) -> int:
    from ckptd.offline.restore import readable_tiers, tool_threads
    from ckptd.offline.verify import verify

    job = validate_job(args.job)
    step = None if args.step is None else validate_step(args.step)
    checked = bad = 0
    found = []
    with tool_threads() as threads:
        for check in verify(readable_tiers(config, args.tier or "auto", threads), job, step, spread=bool(config.peers)):
            checked += 1
            bad += not check.ok
            where = f"{check.tier} {check.job} step {check.step} rank {check.rank}"
            if args.json:
                found.append(dataclasses.asdict(check) | {"ok": check.ok})
            elif check.ok:
                print(f"ok   {where}")
            else:
                print(f"BAD  {where}: {check.error}")
    if args.json:
        print(json.dumps(found))
    if checked == 0:
        print(
            f"ckptd: nothing to verify for job {job}" + (f" step {step}" if step is not None else ""), file=sys.stderr
        )
        return 1
    print(f"{checked - bad} of {checked} shards check", file=sys.stderr)
    return 1 if bad else 0


def cmd_gc(args: argparse.Namespace, config: Config) -> int:
    if (args.all and not args.job) or (args.tier and not args.all):
        raise InvalidArgument("--all needs --job J, and --tier object needs --all")
    request = pb.CollectRequest(dry_run=args.dry_run, job=args.job or "", all=args.all, object=args.tier == "object")
    reply = _client(args, config).call("Collect", request)
    _print_removals(reply.removals, args.dry_run, args.json)
    return 0


def _print_removals(removals: Any, dry_run: bool, as_json: bool) -> None:
    """Print gc's and rm's removals: a line each ("removed TIER JOB step N: why"), or one JSON list."""
    if as_json:
        print(json.dumps([{"tier": r.tier, "job": r.job, "step": r.step, "reason": r.reason} for r in removals]))
        return
    verb = "would remove" if dry_run else "removed"
    for r in removals:
        print(f"{verb} {r.tier} {r.job} step {r.step}: {r.reason}")
    if not removals:
        print(
            "nothing to remove: every job's steps are within its retention here (`ckptd status` says what each "
            "job keeps); steps in use, pinned, or still owed a replica stay too"
        )


def cmd_pin(args: argparse.Namespace, config: Config) -> int:
    job, step = validate_job(args.job), validate_step(args.step)
    pin = args.command == "pin"
    pinned = list(_client(args, config).call("Pin", pb.PinRequest(job=job, step=step, pin=pin)).pinned)
    if args.json:
        print(json.dumps({"job": job, "pinned": pinned}))
        return 0
    print(f"{'pinned' if pin else 'unpinned'} {job} step {step}; pinned steps of {job}: "
          f"{', '.join(map(str, pinned)) or 'none'}")  # fmt: skip
    return 0


def cmd_rm(args: argparse.Namespace, config: Config) -> int:
    job, step = validate_job(args.job), validate_step(args.step)
    object_too = args.tier == "object"
    request = pb.RemoveStepRequest(job=job, step=step, force=args.force, dry_run=args.dry_run, object=object_too)
    _print_removals(_client(args, config).call("RemoveStep", request).removals, args.dry_run, args.json)
    if config.object.url and not object_too and not args.json:
        print(f"the object store ({config.object.url}) was left alone: --tier object removes the step there too")
    return 0


def _parse_step(text: str) -> int:
    if not text.isdigit():
        raise InvalidArgument(f"invalid step {text!r}: a number or latest")
    return validate_step(int(text))


COMMANDS = {
    "serve": cmd_serve,
    "status": cmd_status,
    "ls": cmd_ls,
    "inspect": cmd_inspect,
    "restore": cmd_restore,
    "verify": cmd_verify,
    "gc": cmd_gc,
    "pin": cmd_pin,
    "unpin": cmd_pin,
    "rm": cmd_rm,
    "export": export.cmd_export,
    "import": ingest.cmd_import,
}
