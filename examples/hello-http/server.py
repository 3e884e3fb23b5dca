"""hello-http: a small HTTP server to run as a Bourse image (standard library only).

``/`` answers with the machine's id, the image's digest and version, and the host name;
``/healthz`` with 200. It binds ``PORT`` (the port the worker gave the order's first named
port), or 8080 when unset.
"""

from __future__ import annotations

import json
import os
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_PORT = 8080


def hello() -> dict[str, str]:
    """What ``/`` says: who this machine is and what it runs."""
    return {
        "machine_id": os.environ.get("BOURSE_MACHINE_ID", ""),
        "image_digest": os.environ.get("BOURSE_IMAGE_DIGEST", ""),
        "version": os.environ.get("HELLO_VERSION", ""),
        "hostname": socket.gethostname(),
    }


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._answer(200, b"ok\n", "text/plain")
        elif self.path == "/":
            self._answer(200, json.dumps(hello()).encode() + b"\n", "application/json")
        else:
            self._answer(404, b"not found\n", "text/plain")

    def _answer(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    # The listen backlog. socketserver's default, 5, overflows when an edge releases the
    # requests it held while the machine started, all at once: each connection past it is
    # dropped and its handshake retried by TCP after 1, 2, 4, 8 s (a burst of 60 waited up
    # to 4.5 s, and 16 s under a failover's load).
    request_queue_size = socket.SOMAXCONN


def main() -> None:
    port = int(os.environ.get("PORT") or DEFAULT_PORT)
    server = Server(("", port), Handler)
    print(f"hello-http listening on port {port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
