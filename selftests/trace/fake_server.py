"""A fake streaming completions server on 127.0.0.1 with controlled delays.

Speaks the subset of vLLM's OpenAI API the trace tier uses: ``POST /v1/completions``
(stream: chunked SSE, one chunk per token, ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (prefix-cache counters) and
``POST /reset_prefix_cache``. Prompts are token-id lists.

Cache model: a prompt seen since the last reset is a local hit (all its tokens); with
``connector=True`` a prompt stored before (in any earlier request) is an external hit;
``store_serves=False`` makes a known-bad connector that never serves (no external
hits). A hit answers after ``hit_ttft_s`` instead of ``ttft_s``. ``block_size`` > 0
caches by blocks as vLLM does instead of whole prompts: a hit is the longest prefix
of full blocks (chained, so a block matches only with every block before it) already
cached, at most ``(len - 1) // B`` blocks (vLLM recomputes the last token); the
connector serves the stored blocks after the local hit. ``local_capacity`` > 0
bounds the local (GPU) cache to that many prompts (blocks with ``block_size``),
least recently used out first: a GPU KV cache under pressure. ``by_source=True``
also exports
``vllm:prompt_tokens_by_source`` (local_cache_hit, external_kv_transfer,
local_compute).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeServer:
    """Owns a fake server thread; usable where the campaign expects a VllmServer."""

    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.01,
                 hit_ttft_s: float | None = None, connector: bool = False,
                 store_serves: bool = True, fail_status: int = 0,
                 drop_done: bool = False, model: str = "fake-model",
                 local_capacity: int = 0, by_source: bool = False,
                 block_size: int = 0) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.hit_ttft_s = ttft_s if hit_ttft_s is None else hit_ttft_s
        self.connector = connector
        self.store_serves = store_serves
        self.fail_status = fail_status
        self.drop_done = drop_done
        self.model = model
        self.local_capacity = local_capacity
        self.block_size = block_size
        self.by_source = by_source
        self.argv = ["fake-server", f"connector={connector}"]
        self.local: dict[Any, None] = {}  # insertion order = LRU order
        self.store: set[Any] = set()
        self.counters = {"local_hits": 0, "queries": 0, "ext_hits": 0,
                         "ext_queries": 0, "computed": 0}
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- VllmServer-like surface -------------------------------------------------
    @property
    def url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def client(self, timeout_s: float = 30.0) -> Any:
        from tvc.procs.client import VllmClient

        return VllmClient(self.url, timeout_s=timeout_s)

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._send(200, b"", "text/plain")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps(
                        {"data": [{"id": fake.model}]}).encode(), "application/json")
                elif self.path == "/metrics":
                    self._send(200, fake.metrics_text().encode(), "text/plain")
                else:
                    self._send(404, b"not found", "text/plain")

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(n) if n else b""
                if self.path.startswith("/reset_prefix_cache"):
                    with fake._lock:
                        fake.local.clear()
                    self._send(200, b"", "text/plain")
                    return
                if self.path != "/v1/completions":
                    self._send(404, b"not found", "text/plain")
                    return
                body = json.loads(raw)
                fake.bodies.append(body)
                if fake.fail_status:
                    self._send(fake.fail_status, b'{"error": "injected"}',
                               "application/json")
                    return
                fake.serve_stream(self, body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._httpd is not None

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- behaviour -------------------------------------------------------------------
    def _block_lookup(self, prompt: tuple[int, ...]) -> bool:
        b, n = self.block_size, len(prompt)
        chain, h = [], 0
        for k in range(n // b):
            h = hash((h, prompt[k * b:(k + 1) * b]))
            chain.append(h)
        cap = (n - 1) // b
        local = 0
        while local < cap and chain[local] in self.local:
            local += 1
        ext = 0
        if self.connector:
            self.counters["ext_queries"] += n - local * b
            while (self.store_serves and local + ext < cap
                   and chain[local + ext] in self.store):
                ext += 1
        self.counters["local_hits"] += local * b
        self.counters["ext_hits"] += ext * b
        self.counters["computed"] += n - (local + ext) * b
        for h in chain:
            self.local.pop(h, None)
            self.local[h] = None
            if self.connector:
                self.store.add(h)
        while self.local_capacity and len(self.local) > self.local_capacity:
            del self.local[next(iter(self.local))]
        return local + ext > 0

    def lookup(self, prompt: tuple[int, ...]) -> bool:
        """Account one prompt in the cache counters; True on any hit."""
        with self._lock:
            n = len(prompt)
            self.counters["queries"] += n
            if self.block_size:
                return self._block_lookup(prompt)
            hit = False
            if prompt in self.local:
                self.counters["local_hits"] += n
                hit = True
                del self.local[prompt]  # most recently used again
            elif self.connector:
                self.counters["ext_queries"] += n
                if self.store_serves and prompt in self.store:
                    self.counters["ext_hits"] += n
                    hit = True
            if not hit:
                self.counters["computed"] += n
            self.local[prompt] = None
            while self.local_capacity and len(self.local) > self.local_capacity:
                del self.local[next(iter(self.local))]
            if self.connector:
                self.store.add(prompt)
            return hit

    def serve_stream(self, h: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        counted = [True]

        def done() -> None:
            # counted out before the closing events: the client may send its next
            # request the moment it reads [DONE], before this thread runs on
            with self._lock:
                if counted[0]:
                    self.in_flight -= 1
                    counted[0] = False

        try:
            hit = self.lookup(tuple(body["prompt"]))
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()

            def chunk(obj: Any) -> None:
                data = f"data: {obj}\n\n".encode()
                h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                h.wfile.flush()

            time.sleep(self.hit_ttft_s if hit else self.ttft_s)
            n = int(body["max_tokens"])
            for i in range(n):
                if i:
                    time.sleep(self.itl_s)
                chunk(json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}))
            done()
            chunk(json.dumps({"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": n}}))
            if not self.drop_done:
                chunk("[DONE]")
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        finally:
            done()

    def metrics_text(self) -> str:
        c = self.counters
        lines = [
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{engine="0"}} {c["local_hits"]}',
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{engine="0"}} {c["queries"]}',
        ]
        if self.by_source:
            lines += ["# TYPE vllm:prompt_tokens_by_source counter"] + [
                f'vllm:prompt_tokens_by_source_total{{source="{src}"}} {c[key]}'
                for src, key in (("local_cache_hit", "local_hits"),
                                 ("external_kv_transfer", "ext_hits"),
                                 ("local_compute", "computed"))]
        if self.connector:
            lines += [
                "# TYPE vllm:external_prefix_cache_hits counter",
                f'vllm:external_prefix_cache_hits_total{{engine="0"}} '
                f'{c["ext_hits"]}',
                "# TYPE vllm:external_prefix_cache_queries counter",
                f'vllm:external_prefix_cache_queries_total{{engine="0"}} '
                f'{c["ext_queries"]}',
            ]
        return "\n".join(lines) + "\n"
