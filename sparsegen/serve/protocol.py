"""The server's HTTP/1.1 connections: uvicorn's h11 protocol with two changes a server on an open port needs. A
request line or headers the parser refuses get OpenAI's JSON error shape (uvicorn answers plain text), and a client
must finish a request's headers within ``header_timeout`` seconds of starting them, so that connections that
trickle their headers (slowloris) are closed instead of held for ever. (A body's own deadline is the app's:
``Guard`` in ``sparsegen.serve.server``.)"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class GuardedH11(H11Protocol):
    header_timeout: float = 10.0  # set per server by ``protocol``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.headers_due: asyncio.TimerHandle | None = None
        self._await_headers()

    def _await_headers(self) -> None:
        self.headers_due = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _headers_arrived(self) -> None:
        if self.headers_due is not None:
            self.headers_due.cancel()
            self.headers_due = None

    def data_received(self, data: bytes) -> None:
        between_requests = self.cycle is None or self.cycle.response_complete
        if between_requests and self.headers_due is None:  # the next request on a kept-alive connection begins
            self._await_headers()
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # its headers were read: the request runs
            self._headers_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self.headers_due = None
        if self.transport.is_closing() or not (self.cycle is None or self.cycle.response_complete):
            return
        body = error_body(408, f"the request's headers did not arrive within {self.header_timeout:g} s",
                          "request_timeout")
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = error_body(400, f"malformed HTTP request ({msg.rstrip('.')})", "bad_http_request")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def protocol(header_timeout: float) -> type[GuardedH11]:
    """The protocol class for a server whose clients have ``header_timeout`` seconds to send their headers."""
    return type("GuardedH11", (GuardedH11,), {"header_timeout": header_timeout})
