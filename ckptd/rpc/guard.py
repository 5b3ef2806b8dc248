"""Refuse requests that are not messages at all, quietly: INVALID_ARGUMENT, one log line per caller a minute.

Also names NotAPeer, the refusal of a caller on the peer port that is not a configured peer,
and keeps the log of other refusals a handler answers (a save skipped) to the same pace.

daemon.py registers both services through register(): every method's request
deserializer is wrapped so that bytes which do not parse become a Malformed value
instead of an exception inside gRPC (which answers UNKNOWN and logs a traceback per
request: a client sending garbage would flood the log). The method itself is wrapped
to refuse a Malformed request. Everything here runs on the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ckptd.log_pace import LOG_EVERY_S, LogPace

log = logging.getLogger(__name__)


class NotAPeer(Exception):
    """A caller on the peer port whose certificate names none of the configured peers (PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Malformed:
    """Bytes that did not parse as the method's request message."""

    method: str
    size_bytes: int
    error: str


class RequestGuard:
    """Count malformed requests, and say so (or another refusal) in the log at most once a minute per caller."""

    def __init__(self) -> None:
        self.counters = {"malformed_requests": 0}  # read by the status report at each document
        self._pace = LogPace()  # keyed by (caller, what was refused)

    async def refuse(self, request: Malformed, context: grpc.aio.ServicerContext) -> None:
        """Count, maybe log, and answer INVALID_ARGUMENT (raises, as context.abort does)."""
        self.counters["malformed_requests"] += 1
        caller = self._due(context, "malformed")
        if caller is not None:
            log.warning(
                "refused a malformed %s request of %d bytes from %s (%s); more from it within %.0f s are not logged",
                *(request.method, request.size_bytes, caller, request.error, LOG_EVERY_S),
            )
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request.method} request: {request.error}")

    def note(self, context: grpc.aio.ServicerContext, what: str, message: str) -> None:
        """Log a refusal a handler answered, at most once a minute per caller and kind (what).

        Whoever asks again and again is told so every time; the log hears of it once a minute.
        """
        caller = self._due(context, what)
        if caller is not None:
            log.warning("%s (from %s; more within %.0f s are not logged)", message, caller, LOG_EVERY_S)

    def _due(self, context: grpc.aio.ServicerContext, what: str) -> str | None:
        """Return the caller's name if a line about what from it is due, else None."""
        caller = _caller(str(context.peer() or "unknown"))
        return caller if self._pace.due((caller, what)) else None

    def register(self, add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server,
                 change: Callable[[dict[str, Any]], None] | None = None) -> None:  # fmt: skip
        """Add servicer to server through the generated add_to_server, every method guarded.

        change may adjust the captured method handlers first (raw bytes for bulk methods).
        """
        captured: dict[str, Any] = {}

        class Capture:
            def add_generic_rpc_handlers(self, handlers: Any) -> None:
                pass

            def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
                captured.update(service=service, handlers=handlers)

        add_to_server(servicer, Capture())
        handlers = dict(captured["handlers"])
        if change is not None:
            change(handlers)
        handlers = {name: self._guarded(name, h) for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(captured["service"], handlers),))
        server.add_registered_method_handlers(captured["service"], handlers)

    def _guarded(self, name: str, handler: Any) -> Any:
        parse = handler.request_deserializer
        if parse is None or handler.request_streaming:
            return handler  # raw bytes, or parsed piece by piece by the method itself

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except (DecodeError, ValueError, TypeError) as e:
                return Malformed(name, len(data), f"{type(e).__name__}: {e}")

        if handler.response_streaming:
            stream = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                if isinstance(request, Malformed):
                    await self.refuse(request, context)
                async for reply in stream(request, context):
                    yield reply

            return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            if isinstance(request, Malformed):
                await self.refuse(request, context)
            return await unary(request, context)

        return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)


def _caller(peer: str) -> str:
    """Name a caller by its address without the port: a peer reconnecting is the same caller."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer
