#!/usr/bin/env python3
"""A stand-in for a language model's HTTP API, for examples/envoy-llm.yaml (docs/llm-budgets.md).

Answers every GET or POST with 200 and a small JSON body, and reports the tokens the call "used"
in an `x-tokens` response header, as a model server does. Request headers steer it:

  x-cost: N         report N tokens (default 300)
  x-delay-ms: N     answer after N ms, as a model generating does (to overlap requests)
  x-fail: reset     close the connection without an answer
  x-fail: no-tokens answer 503 without `x-tokens`

Run: python3 examples/model-stub.py 8010   (listens on 127.0.0.1; the port defaults to 8010)
"""

import json
import os
import socket
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What a call costs when the request does not say.
DEFAULT_TOKENS = 300


class Model(BaseHTTPRequestHandler):
    # HTTP/1.1, so that Envoy can keep its connections to the stub open.
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.answer()

    def answer(self):
        # Read the body, if any, so that the connection stays usable for the next request.
        self.rfile.read(int(self.headers.get("content-length") or 0))
        time.sleep(int(self.headers.get("x-delay-ms") or 0) / 1000)
        fail = self.headers.get("x-fail")
        if fail == "reset":
            # A reset (RST, with a linger of 0), as from a model server that crashed; the socket
            # is closed at once, not when the handler's files let go of it.
            linger = struct.pack("ii", 1, 0)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            os.close(self.connection.detach())
            self.close_connection = True
            return
        if fail == "no-tokens":
            self.reply(503, {"error": "overloaded"}, tokens=None)
            return
        tokens = int(self.headers.get("x-cost") or DEFAULT_TOKENS)
        self.reply(200, {"model": self.headers.get("x-model"), "tokens": tokens}, tokens)

    def reply(self, status, body, tokens):
        data = (json.dumps(body) + "\n").encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if tokens is not None:
            self.send_header("x-tokens", str(tokens))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):
        # One line per request on stderr, without the address and date it adds by default.
        sys.stderr.write(format % args + "\n")


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8010
    try:
        ThreadingHTTPServer(("127.0.0.1", port), Model).serve_forever()
    except KeyboardInterrupt:
        pass
