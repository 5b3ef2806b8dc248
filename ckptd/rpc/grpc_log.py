"""Carry what gRPC's C core writes to stderr into the daemon's log: readable, paced, warnings and above only.

gRPC's TLS handshakes run inside its C core, out of Python's sight; the core says how one
failed only in a line of its own on file descriptor 2 ("I1126 18:55:24.123456  1234
ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: ...
CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"), once per attempt, that is
every second while a peer retries. CoreLog points descriptor 2 at a pipe and reads it: a
handshake failure becomes one readable warning a minute per reason (tls_refusal), another
warning or error of the core one line a minute per source line, the core's INFO and debug
lines go, and text that is no line of the core (a library's print) passes through unchanged.
Python's own log handlers are moved to the real stderr first, so they write where they did.

Who calls what: daemon.serve calls start() before its first channel or server and stop()
last (event loop; both quick). The pipe is read on a thread of its own ("grpc-log"), which
never stops reading while the pipe is open: a full pipe would block gRPC's threads.

GRPC_VERBOSITY is left as the operator set it: gRPC 1.85 (checked) logs a failed handshake
at INFO ("Handshake failed with error"), which it shows with GRPC_VERBOSITY unset and hides
with ERROR or NONE, which start() warns about; setting INFO would add a warning of gRPC's own
at every start. Earlier releases logged it at ERROR ("Handshake failed with fatal error");
translate reads both, at any severity. The environment is read when gRPC initialises, before
serve runs, so it is not set here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import TextIO

from ckptd.cluster.tls_refusal import reason, refused_by_the_other_side
from ckptd.log_pace import LogPace

log = logging.getLogger("ckptd.grpc")

JOIN_TIMEOUT_S = 2.0
# severity, date and time, thread, source file:line, message (absl's prefix, and gpr_log's before it)
_CORE_LINE = re.compile(r"^([DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^\s\]]+:\d+)\] ?(.*)$")
_HANDSHAKE_FAILED = re.compile(r"Handshake failed with (?:fatal )?error (.*)")
_LEVELS = {"W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


@dataclass(frozen=True)
class CoreLine:
    """What one line on stderr becomes: a log record (level, paced per kind) or, with level None, itself."""

    level: int | None
    kind: str
    message: str


def translate(line: str) -> CoreLine | None:
    """Return what a line written to stderr becomes in the daemon's log, or None to drop it (the core's INFO)."""
    core = _CORE_LINE.match(line)
    if core is None:
        return CoreLine(None, "", line)
    severity, source, text = core.groups()
    handshake = _HANDSHAKE_FAILED.match(text)
    if handshake is not None:  # at any severity: 1.85 says it at INFO
        words = handshake.group(1)
        why = reason(words)
        if why is None:  # the other side ended it, most often: if over our certificate, its log says why
            return CoreLine(
                logging.WARNING,
                f"handshake:{words}",
                f"a TLS handshake with a peer failed ({words}); where the peer refused this node's certificate, "
                "its log and `ckptd status` say why",
            )
        if refused_by_the_other_side(words):
            return CoreLine(logging.WARNING, f"handshake:{why}", f"a peer refused this node's certificate: {why}")
        return CoreLine(
            logging.WARNING,
            f"handshake:{why}",
            f"refused a peer's certificate in gRPC's TLS handshake: {why}; gRPC does not name the caller "
            "(the calling node's `ckptd status` and log say `certificate rejected by` this node)",
        )
    if severity not in _LEVELS:
        return None
    return CoreLine(_LEVELS[severity], source, f"gRPC: {text} ({source})")


class CoreLog:
    """Read gRPC's C core's stderr into Python logging, between start() and stop()."""

    def __init__(self) -> None:
        self._pace = LogPace()
        self._real_stderr: TextIO | None = None
        self._old_stderr: TextIO | None = None
        self._moved: list[logging.StreamHandler[TextIO]] = []
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Point descriptor 2 at a pipe read by the grpc-log thread; Python's log handlers keep the real stderr."""
        verbosity = os.environ.get("GRPC_VERBOSITY", "").upper()
        if verbosity in ("ERROR", "NONE"):
            log.warning("GRPC_VERBOSITY=%s hides gRPC's failed TLS handshakes from this log (unset it)", verbosity)
        sys.stderr.flush()
        real = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
        read_fd, write_fd = os.pipe()
        self._real_stderr, self._old_stderr = real, sys.stderr
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                handler.setStream(real)
                self._moved.append(handler)
        sys.stderr = real
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._read, args=(read_fd,), name="grpc-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Give descriptor 2 back to the real stderr, and log what the pipe still held."""
        real, old = self._real_stderr, self._old_stderr
        if real is None or old is None:
            return
        os.dup2(real.fileno(), 2)  # the pipe's last writer goes: the reader sees its end
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)  # a child process may hold the pipe open: not waited for
        for handler in self._moved:
            handler.setStream(old)
        sys.stderr = old
        self._moved, self._real_stderr, self._old_stderr = [], None, None
        if self._thread is None or not self._thread.is_alive():
            real.close()

    def _read(self, read_fd: int) -> None:
        with open(read_fd, "rb") as pipe:
            for raw in pipe:
                # A line lost beats gRPC's threads blocked on a full pipe: nothing stops the reading.
                with contextlib.suppress(Exception):
                    self._take(raw.decode(errors="replace").rstrip("\n"))

    def _take(self, line: str) -> None:
        what = translate(line)
        if what is None:
            return
        if what.level is None:
            if self._real_stderr is not None:
                self._real_stderr.write(what.message + "\n")
            return
        if self._pace.due(what.kind):
            log.log(what.level, "%s (more like it within %.0f s are not logged)", what.message, self._pace.every_s)
