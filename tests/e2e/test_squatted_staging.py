"""A staging directory another local user prepared, and files planted in one, are refused (issue 34).

The staging directory's name is known in advance (/dev/shm/ckptd-UID-HASH, or a documented
/dev/shm/ckptd): another user can make it first, pre-create slots to read the snapshots staged
in them, plant a "pending" snapshot for the daemon to flush as a victim's step, or plant links
for the daemon to write through. The attacker's directories and files are made here and handed
to another uid with chown (the interpreter lives under /root, which other uids cannot read, so
they cannot run Python here): the state an attacker leaves is the same.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import ckpt
import pytest
import torch
from ckpt_core.format import COMMIT_NAME
from conftest import CKPTD

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another uid needs root (chown)"),
]

ATTACKER = 61003
SECRET = 0x5EC2E7  # the victim's bytes: an int32 pattern no attacker's file holds by chance


def _serve(node) -> subprocess.CompletedProcess[str]:
    """Run `ckptd serve` expecting it to refuse to start (a daemon that starts is killed at the timeout)."""
    return subprocess.run([*CKPTD, "serve", "--config", str(node.config_path)], capture_output=True, text=True,
                          timeout=30)  # fmt: skip


def _victim_state() -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), SECRET, dtype=torch.int32)}


def _holds_the_secret(data: bytes) -> bool:
    return SECRET.to_bytes(4, "little") * 4 in data


@pytest.mark.parametrize("how", ["another user's", "every user may write", "a link"])
def test_a_staging_directory_someone_else_could_have_prepared_stops_the_daemon_with_exit_2(make_daemon, short_tmp,
                                                                                          how):  # fmt: skip
    node = make_daemon()
    target = short_tmp / "elsewhere"
    target.mkdir(mode=0o755)
    if how == "a link":
        node.staging_dir.symlink_to(target)
    else:
        node.staging_dir.mkdir(mode=0o700)
        if how == "another user's":
            os.chown(node.staging_dir, ATTACKER, ATTACKER)
        else:
            node.staging_dir.chmod(0o777)
    try:
        run = _serve(node)
        assert run.returncode == 2, run.stderr
        assert f"refusing the staging directory {node.staging_dir} (staging.dir)" in run.stderr
        found = {
            "another user's": f"belongs to uid {ATTACKER}",
            "every user may write": "every user may write in",
            "a link": f"is a symbolic link (to {target})",
        }[how]
        assert found in run.stderr and "Traceback" not in run.stderr
        assert list(target.iterdir()) == []
        if how != "a link":
            assert list(node.staging_dir.iterdir()) == []  # nothing written into it
    finally:
        if node.staging_dir.is_symlink():
            node.staging_dir.unlink()


def test_links_planted_in_the_staging_directory_are_never_followed(make_daemon, short_tmp):
    node = make_daemon()
    precious = {name: short_tmp / name for name in ("identity", "slot", "pending", "layout", "old-slot")}
    for path in precious.values():
        path.write_bytes(b"precious " + path.name.encode())
    node.staging_dir.mkdir(mode=0o700)  # the daemon's own directory: links planted in it by the daemon's user,
    (node.staging_dir / ".ckptd-root.tmp").symlink_to(precious["identity"])  # or its group with the old modes
    (node.staging_dir / "old").mkdir(mode=0o700)
    (node.staging_dir / "old" / "rank-00000.slot-0").symlink_to(precious["old-slot"])
    job = node.staging_dir / "victim"
    job.mkdir(mode=0o700)
    node.start()
    # Planted after start, where the next save's slot and markers go.
    (job / "rank-00000.slot-0").symlink_to(precious["slot"])
    (job / "rank-00000.slot-0.pending.json.tmp").symlink_to(precious["pending"])
    (job / "rank-00000.slot-0.layout.tmp").symlink_to(precious["layout"])
    with ckpt.Checkpointer(job="victim", rank=0, world_size=1, address=node.address) as c:
        c.save_async(_victim_state(), step=1).wait("nvme", timeout=60)
        assert torch.equal(c.load(1)["w"], _victim_state()["w"])
    for name, path in precious.items():
        assert path.read_bytes() == b"precious " + name.encode(), f"written through the planted link to {path}"
    assert not (node.staging_dir / "old" / "rank-00000.slot-0").is_symlink()  # refused at start, its name removed
    assert stat.S_ISREG(os.lstat(job / "rank-00000.slot-0").st_mode)
    assert f"refusing {node.staging_dir / 'old' / 'rank-00000.slot-0'} in the staging directory: a link" in node.log()


def test_a_slot_another_user_created_is_never_used_for_a_save(make_daemon):
    node = make_daemon()
    job = node.staging_dir / "victim"
    job.mkdir(parents=True, mode=0o700)
    node.staging_dir.chmod(0o700)
    planted = job / "rank-00000.slot-0"
    planted.write_bytes(bytes(1 << 20))  # a free slot of the right size, as recovery would find one
    planted.chmod(0o666)
    os.chown(planted, ATTACKER, ATTACKER)
    with open(planted, "rb") as attacker:  # the attacker keeps its file open, to read what lands in it
        node.start()
        with ckpt.Checkpointer(job="victim", rank=0, world_size=1, address=node.address) as c:
            c.save_async(_victim_state(), step=1).wait("nvme", timeout=60)
            assert torch.equal(c.load(1)["w"], _victim_state()["w"])
        assert not _holds_the_secret(os.pread(attacker.fileno(), 1 << 20, 0))
    assert f"refusing {planted} in the staging directory: a file of uid {ATTACKER}" in node.log()
    assert all(p.stat().st_uid == os.geteuid() for p in job.iterdir())


@pytest.mark.parametrize("owned", ["files", "job directory"])
def test_a_pending_snapshot_another_user_planted_is_never_flushed(make_daemon, owned):
    # The attacker's snapshot: a real one, as a daemon leaves it in its staging directory, copied over.
    template = make_daemon(name="template").start()
    with ckpt.Checkpointer(job="victimjob", rank=0, world_size=1, address=template.address) as c:
        c.save_async({"w": torch.arange(10)}, step=7).wait("nvme", timeout=60)
    template.kill()
    node = make_daemon()
    node.staging_dir.mkdir(mode=0o700)
    planted = node.staging_dir / "victimjob"
    shutil.copytree(template.staging_dir / "victimjob", planted)
    assert any(p.name.endswith(".pending.json") for p in planted.iterdir())
    for path in [planted, *planted.iterdir()] if owned == "job directory" else list(planted.iterdir()):
        os.chown(path, ATTACKER, ATTACKER)
    node.start()
    with ckpt.Checkpointer(job="victimjob", rank=0, world_size=1, address=node.address) as c:
        assert c.latest_step() is None
        with pytest.raises(ckpt.NotFound):
            c.load(7)
    ls = node.cli("ls", "--address", node.address)
    assert "victimjob" not in ls.stdout, ls.stdout
    assert "victimjob step 7 is complete" not in node.log()
    assert f"a {'directory' if owned == 'job directory' else 'file'} of uid {ATTACKER}" in node.log()


@pytest.mark.parametrize("umask", [0o000, 0o077], ids=["umask000", "umask077"])
@pytest.mark.parametrize("group", ["", "0"], ids=["no-group", "group0"])
def test_modes_are_explicit_whatever_the_umask(make_daemon, umask, group):
    node = make_daemon(f'group = "{group}"\n' if group else "")  # appended to [staging]
    node.wrapper = ["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh"]
    node.start()
    with ckpt.Checkpointer(job="modes", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(100)}, step=1).wait("nvme", timeout=60)
    assert node.stop() == 0

    def mode(path) -> int:
        return stat.S_IMODE(os.lstat(path).st_mode)

    durable = [node.root, *node.root.rglob("*")]
    assert durable and {oct(mode(p)) for p in durable if p.is_dir()} == {"0o750"}, durable
    assert {oct(mode(p)) for p in durable if p.is_file()} == {"0o640"}, [(p, oct(mode(p))) for p in durable]
    assert any(p.name == COMMIT_NAME for p in durable)
    staging = [node.staging_dir, *node.staging_dir.rglob("*")]
    dirs = {oct(mode(p)) for p in staging if p.is_dir()}
    slots = {oct(mode(p)) for p in staging if p.is_file() and p.name.split(".")[-1].startswith("slot-")}
    markers = {oct(mode(p)) for p in staging if p.is_file() and not p.name.split(".")[-1].startswith("slot-")}
    assert dirs == ({"0o700"} if not group else {"0o750"})
    assert slots == ({"0o600"} if not group else {"0o660"})
    assert markers == {"0o600"}
