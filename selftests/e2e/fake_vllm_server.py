"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in self-tests.

Accepts the argv VllmServer builds (``--model M --host H --port P ...``) and behaves
as ``FAKE_VLLM_MODE`` says:

- ``healthy``: after ``FAKE_VLLM_DELAY_S`` serves /health, /v1/models, /metrics (the
  text of ``FAKE_VLLM_METRICS``), POST /reset_prefix_cache and /v1/completions (greedy
  fake: token i = (sum(prompt) + i) % 97 + 3; streamed with ``"stream": true``).
- ``die``: prints a few lines, then a fatal one, and exits with code 3.
- ``die-profiling``: dies with vLLM's memory-profiling assertion (exit 1).
- ``hang``: never answers /health.
- ``ignore-term``: like ``healthy`` but ignores SIGTERM (teardown must SIGKILL).

Without ``FAKE_VLLM_METRICS`` it serves live counters: a prompt seen before is a GPU
prefix-cache hit of ``(len - 1) // 16 * 16`` tokens until POST /reset_prefix_cache.
With ``--kv-transfer-config`` in its argv it also emulates a connector: a stored
prompt is then an external hit of ``(len - 2) // 16 * 16`` tokens (ExampleConnector's
rule at B = 16), logged as "External Cache Hit!". Without it (a baseline server) it
has no store. ``FAKE_VLLM_CONNECTOR``: ``good`` (default), ``corrupt`` (outputs
served from the store differ), ``forgetful`` (stores nothing), ``skew`` (every
output of the connector server differs from a plain server's, pass 1 included),
``cross`` (a request served from the store while another one is gets the other's
output: one request's KV served to another under concurrency).

``FAKE_VLLM_LOAD_FAILURE`` makes every load from the store fail, as vLLM's scheduler
handles it: ``recompute`` (logs "Recovered from KV load failure", output as
computed), ``recompute-garbage`` (logs it, output wrong), ``recompute-silent``
(output right, nothing logged: the fault never fired), ``fail`` (logs "Failing 1
request(s) due to KV load failure", a 500 error event in the stream / HTTP 500),
``fail-garbage`` (logs it, answers tokens instead of an error), ``fail-dies`` (the
error, then the server process exits), ``fail-empty`` (logs it, then ends the stream
with a usage chunk and no token, no error: vLLM 0.26.0 with an asynchronously
loading connector on the H200).

Always starts a grandchild (``sleep``) in its process group and writes
``{"server": pid, "child": pid}`` to ``FAKE_VLLM_PIDS``; writes argv and the
environment it saw to ``FAKE_VLLM_ARGV`` (JSON) when set.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode = os.environ.get("FAKE_VLLM_MODE", "healthy")
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
host = argv[argv.index("--host") + 1]
model = argv[argv.index("--model") + 1]
if os.environ.get("FAKE_VLLM_ARGV"):
    with open(os.environ["FAKE_VLLM_ARGV"], "w") as f:
        json.dump({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, f)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if os.environ.get("FAKE_VLLM_PIDS"):
    with open(os.environ["FAKE_VLLM_PIDS"], "w") as f:
        json.dump({"server": os.getpid(), "child": child.pid}, f)
print(f"INFO fake api server for {model} on {host}:{port}", flush=True)
if mode == "die":
    print("INFO loading weights", flush=True)
    print("ERROR torch.OutOfMemoryError: CUDA out of memory (fake)", flush=True)
    sys.exit(3)
if mode == "die-profiling":  # vLLM's assert when GPU memory was freed meanwhile
    print("AssertionError: Error in memory profiling. Initial free memory 130.1 GiB,"
          " current free memory 130.6 GiB. This happens when other processes "
          "sharing the same container release GPU memory (fake)", flush=True)
    sys.exit(1)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "hang":
    while True:
        time.sleep(1)
time.sleep(float(os.environ.get("FAKE_VLLM_DELAY_S", "0")))
METRICS = open(os.environ["FAKE_VLLM_METRICS"]).read() if os.environ.get(
    "FAKE_VLLM_METRICS") else None
CONNECTOR = os.environ.get("FAKE_VLLM_CONNECTOR", "good")
HAS_CONNECTOR = "--kv-transfer-config" in argv
LOAD_FAILURE = os.environ.get("FAKE_VLLM_LOAD_FAILURE", "")
CROSS_WINDOW_S = 0.3  # "cross": requests served from the store this close collide
B = 16
STORE, LOCAL = set(), set()
C = {"ext": 0, "prefix": 0, "src_ext": 0, "src_local": 0, "src_compute": 0, "ok": 0}
LOCK = threading.Lock()
RECENT = []  # "cross": (time, prompt) of requests served from the store
ERROR_BODY = {"error": {"message": "Internal server error",
                        "type": "InternalServerError", "param": None, "code": 500}}


def live_metrics():
    lab = f'engine="0",model_name="{model}"'
    out = []
    for name, key in (("vllm:external_prefix_cache_hits", "ext"),
                      ("vllm:prefix_cache_hits", "prefix")):
        out += [f"# TYPE {name} counter", f"{name}_total{{{lab}}} {C[key]}.0"]
    out.append("# TYPE vllm:prompt_tokens_by_source counter")
    for src, key in (("external_kv_transfer", "src_ext"),
                     ("local_cache_hit", "src_local"),
                     ("local_compute", "src_compute")):
        out.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{src}"}} '
                   f"{C[key]}.0")
    out += ["# TYPE vllm:request_success counter",
            f'vllm:request_success_total{{{lab},finished_reason="length"}} '
            f"{C['ok']}.0",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{B}",engine="0"}} 1.0']
    return "\n".join(out) + "\n"


def account(prompt):
    """Update the counters for one request; True when served from the store."""
    key, n = tuple(prompt), len(prompt)
    from_store = False
    with LOCK:
        if key in LOCAL:
            hit = (n - 1) // B * B
            C["prefix"] += hit
            C["src_local"] += hit
            C["src_compute"] += n - hit
        elif HAS_CONNECTOR and key in STORE:
            hit = (n - 2) // B * B
            C["ext"] += hit
            C["src_ext"] += hit
            C["src_compute"] += n - hit
            from_store = True
            print("INFO External Cache Hit!", flush=True)
        else:
            C["src_compute"] += n
        if HAS_CONNECTOR and CONNECTOR != "forgetful":
            STORE.add(key)
        LOCAL.add(key)
    return from_store


def served_tokens(prompt, n, from_store):
    """The output tokens, as the connector mode and the load-failure mode make them.

    Returns (tokens, error): error is "" or the failure to report instead.
    """
    toks = fake_tokens(prompt, n)
    if HAS_CONNECTOR and CONNECTOR == "skew":
        toks = [t + 2 for t in toks]
    if not from_store:
        return toks, ""
    if LOAD_FAILURE:
        hit = (len(prompt) - 2) // B * B
        if LOAD_FAILURE.startswith("recompute"):
            if LOAD_FAILURE != "recompute-silent":
                print("WARNING Recovered from KV load failure: 1 request(s) "
                      f"rescheduled ({hit} tokens affected).", flush=True)
            return ([t + 1 for t in toks] if LOAD_FAILURE == "recompute-garbage"
                    else toks), ""
        print("ERROR Failing 1 request(s) due to KV load failure "
              f"(failure_policy=fail, {hit} tokens affected). Request IDs: "
              "{'cmpl-fake'}", flush=True)
        if LOAD_FAILURE == "fail-garbage":
            return [t + 1 for t in toks], ""
        return toks, LOAD_FAILURE
    if CONNECTOR == "corrupt":
        return [t + 1 for t in toks], ""
    if CONNECTOR == "cross":
        now = time.monotonic()
        with LOCK:
            RECENT.append((now, list(prompt)))
        time.sleep(CROSS_WINDOW_S)
        with LOCK:
            other = next((p for t, p in RECENT if abs(t - now) < CROSS_WINDOW_S
                          and p != list(prompt)), None)
        if other is not None:
            return fake_tokens(other, n), ""
    return toks, ""


def die_soon():
    """fail-dies: the engine goes down right after answering."""
    def _exit():
        time.sleep(0.2)
        print("ERROR EngineCore died (fake)", flush=True)
        os._exit(1)
    threading.Thread(target=_exit, daemon=True).start()


def fake_tokens(prompt, n):
    return [(sum(prompt) + i) % 97 + 3 for i in range(n)]


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        print("INFO http", *a, flush=True)

    def _send(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, "")
        elif self.path == "/metrics":
            self._send(200, METRICS if METRICS is not None else live_metrics(),
                       "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": model}]}))
        else:
            self._send(404, "{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))
                          or b"{}")
        if self.path.startswith("/reset_prefix_cache"):
            LOCAL.clear()
            self._send(200, json.dumps({"success": True}))
            return
        if self.path != "/v1/completions":
            self._send(404, "{}")
            return
        prompt, n = body["prompt"], body.get("max_tokens", 16)
        from_store = account(prompt) if isinstance(prompt, list) else False
        toks, error = served_tokens(prompt, n, from_store)
        top = [{f"token_id:{t}": -0.5, f"token_id:{t + 1}": -1.5} for t in toks]

        def choice(ids, tops, first):
            return {"index": 0, "text": " ".join(f"w{t}" for t in ids),
                    "token_ids": ids,
                    "prompt_token_ids": prompt if first else None,
                    "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                 "token_logprobs": [-0.5] * len(ids),
                                 "top_logprobs": tops}}
        if error and not body.get("stream"):
            self._send(500, json.dumps(ERROR_BODY))
            if error == "fail-dies":
                die_soon()
            return
        if error == "fail-empty" and body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            usage = {"choices": [], "usage": {"prompt_tokens": len(prompt),
                                              "completion_tokens": 0}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
                             .encode())
            self.wfile.flush()
            return
        if error:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(f"data: {json.dumps(ERROR_BODY)}\n\ndata: [DONE]\n\n"
                             .encode())
            self.wfile.flush()
            if error == "fail-dies":
                die_soon()
            return
        if not body.get("stream"):
            C["ok"] += 1
            self._send(200, json.dumps({"choices": [choice(toks, top, True)],
                                        "usage": {"prompt_tokens": len(prompt)}}))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, t in enumerate(toks):
            chunk = {"choices": [choice([t], [top[i]], i == 0)]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        usage = {"choices": [], "usage": {"prompt_tokens": len(prompt)}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        C["ok"] += 1


print("INFO Application startup complete.", flush=True)
class Server(ThreadingHTTPServer):
    request_queue_size = 128  # listen backlog: 16+ clients connect at once
    daemon_threads = True


Server((host, port), H).serve_forever()
