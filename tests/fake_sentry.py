"""A real HTTP endpoint on 127.0.0.1 that receives Sentry envelopes and decodes them."""

from __future__ import annotations

import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse_envelope(data: bytes) -> tuple[dict, list[tuple[dict, object]]]:
    """Envelope = header line, then items: an item-header line and a payload (length-delimited
    when the header says `length`, else up to the next newline)."""
    header_line, _, rest = data.partition(b"\n")
    items = []
    while rest.strip():
        item_line, _, rest = rest.partition(b"\n")
        item = json.loads(item_line)
        if "length" in item:
            payload, rest = rest[: item["length"]], rest[item["length"] :]
            rest = rest[1:] if rest.startswith(b"\n") else rest
        else:
            payload, _, rest = rest.partition(b"\n")
        try:
            body: object = json.loads(payload)
        except ValueError:
            body = payload
        items.append((item, body))
    return json.loads(header_line), items


class FakeSentry:
    def __init__(self):
        self.envelopes: list[tuple[dict, list]] = []
        self.auth: list[str] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = self.headers.get("Content-Encoding", "")
                if enc == "gzip":
                    data = gzip.decompress(data)
                elif enc == "br":
                    import brotli

                    data = brotli.decompress(data)
                with sink.lock:
                    sink.auth.append(self.headers.get("X-Sentry-Auth", ""))
                    sink.envelopes.append(parse_envelope(data))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.dsn = f"http://publickey123@127.0.0.1:{self.port}/42"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def items(self, kind: str) -> list:
        with self.lock:
            return [
                body for _, items in self.envelopes for h, body in items if h.get("type") == kind
            ]

    def transactions(self) -> list[dict]:
        return self.items("transaction")

    def logs(self) -> list[dict]:
        return [entry for batch in self.items("log") for entry in batch.get("items", [])]

    def wait_for(self, predicate, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    def __enter__(self) -> FakeSentry:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
