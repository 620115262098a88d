"""The gateway's HTTP connections: uvicorn's h11 protocol, with a deadline for request headers.

uvicorn closes a kept-alive connection that sends nothing, but not one that never finishes its
first request's headers: a client sending a byte now and then, or nothing, holds a connection
(and a file descriptor) for good. Here every request's headers must be complete within
`header_timeout_s` of the connection (the first request) or of their first byte (the next
ones); otherwise the connection gets 408 and is closed.
"""

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout_s = 10.0  # set by `with_header_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request's headers are still on their way
            if self._header_deadline is None:
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.conn.our_state is h11.IDLE:
                self.transport.write(REQUEST_TIMEOUT)
            self.transport.close()


def with_header_timeout(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's `http`, with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
