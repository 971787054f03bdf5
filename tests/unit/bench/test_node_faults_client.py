"""bench.node_faults' client tells a complete answer, an OpenAI-shaped error, a stream
cut off mid-body and one that ends short without an error apart: a cut chunked body is
not a quiet end (http.client's line iteration hides it; the bench must not)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import node_faults


def _events(*chunks: dict | str) -> list[bytes]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]


def _serve(events: list[bytes], end: str) -> Iterator[str]:
    class Pod(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for e in events:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(e), e))
            if end == "complete":
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self.close_connection = True  # "cut": no terminating chunk, then the close

    server = ThreadingHTTPServer(("127.0.0.1", 0), Pod)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


TOKEN = {"choices": [{"text": "a"}]}
USAGE = {"choices": [], "usage": {"completion_tokens": node_faults.MAX_TOKENS}}


@pytest.mark.parametrize(("events", "end", "outcome"), [
    (_events(TOKEN, USAGE, "[DONE]"), "complete", "ok"),
    (_events(TOKEN, {"error": {"message": "gone", "code": 503}}), "complete", "retryable"),
    (_events(TOKEN, TOKEN), "cut", "reset"),  # today's client: "lost", ended without [DONE]
    (_events(TOKEN, TOKEN), "complete", "lost"),  # a clean end, but no [DONE]: not an error
])
def test_each_way_a_stream_ends_is_told_apart(events, end, outcome):
    for url in _serve(events, end):
        got, detail = node_faults.stream_once(url, "m", [1, 2, 3])
        assert got == outcome, detail
