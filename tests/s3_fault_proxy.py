#!/usr/bin/env python3
"""A fault-injecting HTTP proxy in front of an S3-compatible server, for
cairn's object storage tests.

    s3_fault_proxy.py --upstream http://127.0.0.1:5000 --port 5001

Requests are forwarded to the upstream server one by one (each answer
closes its connection), except where a fault is armed:

    POST /__fault__  {"fault": KIND, "count": N, "method": "PUT",
                      "path_contains": "data-", "status": 503,
                      "code": "SlowDown", "seconds": 5}

arms KIND for the next N requests (-1: all) whose method and path match:

    status    answer `status` with an S3 error document naming `code`,
              without forwarding
    truncate  forward, then send half of the answer's body under the full
              Content-Length and close
    short     forward, then send the body cut by 10 bytes under a matching
              (short) Content-Length
    corrupt   forward, then flip one byte in the middle of the body
    hang      wait `seconds` without answering, then close
    none      disarm

GET /__stats__ answers {"requests": R, "faults": F}.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_lock = threading.Lock()
_armed = {"fault": "none", "count": 0}
_stats = {"requests": 0, "faults": 0}
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length",
        "proxy-connection", "upgrade", "te", "trailer"}


def _take(method, path):
    """The armed fault for this request, consuming one of its count."""
    with _lock:
        _stats["requests"] += 1
        a = _armed
        if a["fault"] == "none" or a["count"] == 0:
            return None
        if a.get("method") and a["method"] != method:
            return None
        if a.get("path_contains") and a["path_contains"] not in path:
            return None
        if a["count"] > 0:
            a["count"] -= 1
        _stats["faults"] += 1
        return dict(a)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream = None  # (host, port)

    def log_message(self, *args):
        pass

    def _send(self, status, headers, body, declared=None):
        self.send_response_only(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length",
                         str(len(body) if declared is None else declared))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()
        self.close_connection = True

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path.startswith("/__fault__"):
            global _armed
            with _lock:
                _armed = json.loads(body or b"{}")
                _armed.setdefault("count", -1)
            return self._send(200, [], b"armed")
        if self.path.startswith("/__stats__"):
            with _lock:
                text = json.dumps(_stats).encode()
            return self._send(200, [("Content-Type", "application/json")], text)
        fault = _take(self.command, urllib.parse.unquote(self.path))
        kind = fault["fault"] if fault else None
        if kind == "status":
            code = fault.get("code", "InternalError")
            doc = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}'
                   f'</Code><Message>injected by s3_fault_proxy</Message>'
                   f'<RequestId>fault-{_stats["requests"]}</RequestId>'
                   f'</Error>').encode()
            return self._send(int(fault.get("status", 500)),
                              [("Content-Type", "application/xml")], doc)
        if kind == "hang":
            time.sleep(float(fault.get("seconds", 30)))
            self.close_connection = True
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in _HOP}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        out_headers = [(k, v) for k, v in resp.getheaders()
                       if k.lower() not in _HOP]
        conn.close()
        declared = None
        if self.command == "HEAD":
            declared = resp.getheader("Content-Length", "0")
        elif kind == "truncate" and len(data) > 1:
            declared = len(data)
            data = data[: len(data) // 2]
        elif kind == "short" and len(data) > 10:
            data = data[:-10]
        elif kind == "corrupt" and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0x5A]) + data[mid + 1:]
        self._send(resp.status, out_headers, data, declared)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True,
                        help="http://host:port of the real server")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    u = urllib.parse.urlparse(args.upstream)
    Handler.upstream = (u.hostname, u.port or 80)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
