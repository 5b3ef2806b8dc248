"""A socket directory another local user prepared is refused, by the client and by the daemon (issue 34).

The default socket without XDG_RUNTIME_DIR is TMPDIR/ckptd-UID/ckptd.sock: a name anyone can take first.
The attacker's directory is made here and handed to another uid with chown (the interpreter of this
machine lives under /root, which other uids cannot read, so they cannot run Python here): the state an
attacker leaves is the same. Client and daemon run as the test's user, in a TMPDIR of the test's own
(mode 1777, as /tmp), with no XDG_RUNTIME_DIR or CKPTD_ADDRESS, as in a batch job's shell.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from ckpt_core.owned_paths import dir_problem
from conftest import CKPTD

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another uid needs root (chown)"),
]

ATTACKER = 61002


def _batch_shell(tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "CKPTD_ADDRESS")}
    return {**env, "TMPDIR": str(tmpdir)}


@pytest.fixture
def shared_tmp(short_tmp: Path) -> Path:
    """A directory like /tmp: every user may make entries in it, sticky."""
    path = short_tmp / "tmp"
    path.mkdir()
    path.chmod(0o1777)
    return path


def test_the_client_refuses_a_default_socket_directory_another_user_made_and_sends_nothing(shared_tmp):
    squatted = shared_tmp / f"ckptd-{os.getuid()}"
    squatted.mkdir(mode=0o755)
    received: list[bytes] = []
    with socket.socket(socket.AF_UNIX) as fake:  # the attacker's daemon, answering on the victim's default path
        fake.bind(str(squatted / "ckptd.sock"))
        fake.listen(8)
        fake.settimeout(0.5)
        os.chown(squatted / "ckptd.sock", ATTACKER, ATTACKER)
        os.chown(squatted, ATTACKER, ATTACKER)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = fake.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        received.append(conn.recv(1 << 16))
                    except OSError:
                        received.append(b"")

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        victim = subprocess.run(
            [sys.executable, "-c", "import ckpt; ckpt.Checkpointer(job='victim').latest_step()"],
            env=_batch_shell(shared_tmp), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        stop.set()
        server.join(10)
    assert victim.returncode != 0
    assert "DaemonUnavailable: refusing the default ckptd socket" in victim.stderr
    assert f"belongs to uid {ATTACKER}" in victim.stderr
    assert not any(received)  # not a byte sent to the fake daemon


def test_the_daemon_refuses_a_socket_directory_another_user_made_and_exits_2(make_daemon, shared_tmp):
    squatted = shared_tmp / "ckptd-squatted"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, ATTACKER, ATTACKER)
    node = make_daemon()
    node.config_path.write_text(node.config_path.read_text().replace(str(node.socket), str(squatted / "d.sock")))
    run = subprocess.run([*CKPTD, "serve", "--config", str(node.config_path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"refusing the socket directory {squatted} (node.socket)" in run.stderr
    assert f"belongs to uid {ATTACKER}" in run.stderr
    assert list(squatted.iterdir()) == []  # nothing bound, nothing written there


def test_a_sound_socket_directory_is_a_private_real_directory_of_the_owner(short_tmp):
    own = short_tmp / "own"
    own.mkdir(mode=0o750)
    assert dir_problem(own, {os.geteuid()}) is None
    assert dir_problem(short_tmp / "absent", {os.geteuid()}) is None
    link = short_tmp / "link"
    link.symlink_to(own)
    assert "symbolic link" in (dir_problem(link, {os.geteuid()}) or "")
    own.chmod(0o777)
    assert "every user may write" in (dir_problem(own, {os.geteuid()}) or "")
    own.chmod(0o750)
    os.chown(own, ATTACKER, ATTACKER)
    assert f"belongs to uid {ATTACKER}" in (dir_problem(own, {os.geteuid()}) or "")


def test_the_client_and_daemon_take_their_own_default_socket_directory(make_daemon, shared_tmp):
    node = make_daemon()
    node.config_path.write_text(node.config_path.read_text().replace(f'socket = "{node.socket}"\n', ""))
    node.env = {"TMPDIR": str(shared_tmp), "XDG_RUNTIME_DIR": ""}  # no runtime directory: the TMPDIR default
    node.socket = shared_tmp / f"ckptd-{os.getuid()}" / "ckptd.sock"  # where the default puts it
    node.start()
    code = "import ckpt, torch; c = ckpt.Checkpointer(job='own'); c.save_async({'w': torch.ones(3)}, step=1)" \
           ".wait('nvme', timeout=60); print(c.latest_step())"  # fmt: skip
    env = {k: v for k, v in _batch_shell(shared_tmp).items() if not k.startswith("CKPTD_")}
    own = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert own.returncode == 0 and own.stdout.strip() == "1", own.stderr
