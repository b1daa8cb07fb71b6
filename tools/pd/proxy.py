"""A small P/D proxy for vLLM's OpenAI completions API (the role vLLM's toy proxy plays):
each request goes to P with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true}``, then to D with P's ``kv_transfer_params``; D's answer is
the answer. Standard library only.

    python proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

``POST /v1/completions`` (non-streaming) is proxied; ``GET /health`` answers 200 once both
engines do. A failure of either engine is answered 502 with what it said.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Proxy(BaseHTTPRequestHandler):
    prefill = decode = ""
    timeout = 600.0

    def log_message(self, fmt, *args):  # one line a request, on stderr
        sys.stderr.write("proxy: " + (fmt % args) + "\n")

    def answer(self, code, doc):
        b = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        if self.path != "/health":
            return self.answer(404, {"error": f"no {self.path}"})
        for url in (self.prefill, self.decode):
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
            except Exception as e:
                return self.answer(503, {"error": f"{url}: {e}"})
        self.answer(200, {"ok": True})

    def do_POST(self):
        if self.path != "/v1/completions":
            return self.answer(404, {"error": f"no {self.path}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        except ValueError as e:
            return self.answer(400, {"error": f"request body: {e}"})
        if body.get("stream"):
            return self.answer(400, {"error": "stream: not proxied (non-streaming only)"})
        first = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        try:
            p = post(self.prefill + "/v1/completions", first, self.timeout)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return self.answer(502, {"error": f"prefill {self.prefill}: {e}"})
        params = p.get("kv_transfer_params")
        if not params:
            return self.answer(502, {"error": "prefill answered without kv_transfer_params", "prefill": p})
        try:
            d = post(self.decode + "/v1/completions", dict(body, kv_transfer_params=params), self.timeout)
        except urllib.error.HTTPError as e:
            return self.answer(502, {"error": f"decode {self.decode}: {e.code} {e.read()[:500]!r}"})
        except (urllib.error.URLError, OSError, ValueError) as e:
            return self.answer(502, {"error": f"decode {self.decode}: {e}"})
        self.answer(200, d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    a = ap.parse_args()
    Proxy.prefill, Proxy.decode = a.prefill.rstrip("/"), a.decode.rstrip("/")
    srv = ThreadingHTTPServer((a.host, a.port), Proxy)
    print(f"proxy on http://{a.host}:{srv.server_address[1]}: P {Proxy.prefill}, D {Proxy.decode}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
