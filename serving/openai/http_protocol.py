"""uvicorn's h11 protocol with deadlines for receiving a request: the slowloris defence.

uvicorn closes a kept-alive connection that stays idle for ``--timeout-keep-alive`` seconds, but puts no deadline
on a request while it arrives: a client that sends half its headers and then a byte now and then, or declares a
Content-Length far beyond the body it sends, holds its connection (and a place under ``--max-connections``) for
as long as it likes; so does a connection that never sends anything. Here a request's headers must be complete
``header_timeout`` seconds after its first byte arrived (a new connection's first request: after it connected),
and its body ``body_timeout`` seconds after its headers; otherwise the client gets a 408 (when no response has
started) and the connection is closed. A handler still waiting for the body sees a disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kiln.serving")


def _timeout_response(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol whose requests must arrive within ``header_timeout`` (headers) and ``body_timeout`` (body)
    seconds. uvicorn builds one per connection: give it the timeouts with ``functools.partial``."""

    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None   # what the deadline is for: "headers" or "body"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arm or drop the deadline for where the client is in sending its request."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:   # part of the next request's headers
            self._arm("headers")
        elif self._phase != "headers" or state is not h11.IDLE or self.cycle is not None:
            self._disarm()   # the request arrived (or the connection idles: uvicorn's keep-alive timeout)

    def _arm(self, phase: str) -> None:
        if self._phase == phase:
            return   # a deadline runs from the start of the phase, not from the last byte
        self._disarm()
        seconds = self.header_timeout if phase == "headers" else self.body_timeout
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        what = "headers" if phase == "headers" else "body"
        logger.debug("closing a connection from %s: its request %s did not arrive within %g s", self.client, what,
                     seconds)
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response(f"the request {what} did not arrive within {seconds:g} s"))
        if cycle is not None:   # the handler waiting for the body sees the client go
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
