"""A stand-in for a vLLM server of a P/D pair (or a baseline) in self-tests.

Accepts the argv :class:`tvc.procs.vllm_server.VllmServer` builds. Its greedy output is
token i = (sum(prompt) + i) % 97 + 3 (top-2 logprobs -0.1 / -2.5), like a baseline
engine. With ``--kv-transfer-config`` it plays the connector by ``kv_role``:

- producer: on each completion it "sends" the prompt's KV, keyed as the routing in
  ``FAKE_PD_ROUTING`` says (``request_id``: to the consumer address parsed out of
  ``X-Request-Id`` with P2pNcclConnector's regex; ``kv_transfer_params``: under a
  token it returns in ``kv_transfer_params``; ``shared_store``: under the prompt's
  hash), as a file in ``FAKE_PD_DIR``;
- consumer: looks the KV up the same way (its own ``kv_ip:kv_port``, the
  ``remote_token`` in ``kv_transfer_params``, the prompt hash); found -> external
  hit of ``len - 1`` tokens. ``FAKE_PD_FAULT``: ``corrupt`` (output from loaded KV is
  shifted), ``lose`` (the producer sends nothing).

``/metrics`` has ``vllm:external_prefix_cache_hits_total``,
``vllm:request_success_total`` and ``vllm:cache_config_info{block_size}`` (from
``--block-size``, 16 by default, or ``FAKE_PD_BLOCK_SIZE``).
"""

import hashlib
import json
import os
import re
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
host = argv[argv.index("--host") + 1]
model = argv[argv.index("--model") + 1]
cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1]) \
    if "--kv-transfer-config" in argv else {}
role = cfg.get("kv_role", "none")
block = os.environ.get("FAKE_PD_BLOCK_SIZE") or (
    argv[argv.index("--block-size") + 1] if "--block-size" in argv else "16")
ROUTING = os.environ.get("FAKE_PD_ROUTING", "shared_store")
DIR = os.environ.get("FAKE_PD_DIR", "/tmp")
FAULT = os.environ.get("FAKE_PD_FAULT", "")
C = {"hits": 0, "ok": 0}
print(f"INFO fake {role} server on {host}:{port} "
      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, "
      f"VLLM_HOST_IP={os.environ.get('VLLM_HOST_IP')})", flush=True)


def key_of(prompt):
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:16]


def slot(rid, body, prompt, sending):
    """File the KV travels through, or None when the routing data is missing."""
    if ROUTING == "request_id":
        rx = r"___decode_addr_(.*):(\d+)" if sending else None
        if sending:
            m = re.search(rx, rid or "")
            return m and os.path.join(DIR, f"{m.group(1)}_{m.group(2)}", rid)
        if not re.search(r"___prefill_addr_(.*):(\d+)___", rid or ""):
            return None
        return os.path.join(DIR, f"{cfg['kv_ip']}_{cfg['kv_port']}", rid)
    if ROUTING == "kv_transfer_params":
        p = body.get("kv_transfer_params") or {}
        tok = p.get("remote_token") if not sending else uuid.uuid4().hex
        return tok and os.path.join(DIR, "params", tok)
    return os.path.join(DIR, "store", key_of(prompt))


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"data": [{"id": model}]})
        elif self.path == "/metrics":
            text = "\n".join([
                f"vllm:external_prefix_cache_hits_total {C['hits']}.0",
                f"vllm:request_success_total {C['ok']}.0",
                f'vllm:cache_config_info{{block_size="{block}"}} 1.0', ""])
            self._send(200, text.encode(), "text/plain")
        else:
            self._send(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rid = self.headers.get("X-Request-Id")
        prompt = body["prompt"]
        n = body["max_tokens"]
        shift = 0
        extra = {}
        if role == "kv_producer":
            path = slot(rid, body, prompt, True)
            if path and FAULT != "lose":
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(prompt, f)
            if ROUTING == "kv_transfer_params" and path:
                extra["kv_transfer_params"] = {"remote_token": os.path.basename(path)}
        elif role == "kv_consumer":
            path = slot(rid, body, prompt, False)
            if path and os.path.exists(path) and json.load(open(path)) == prompt:
                C["hits"] += len(prompt) - 1
                shift = 1 if FAULT == "corrupt" else 0
        s = sum(prompt)
        toks = [(s + i) % 97 + 3 + shift for i in range(n)]
        choice = {"index": 0, "text": "", "token_ids": toks, "logprobs": {
            "tokens": [f"token_id:{t}" for t in toks],
            "token_logprobs": [-0.1] * n,
            "top_logprobs": [{f"token_id:{t}": -0.1, f"token_id:{t + 1}": -2.5}
                             for t in toks]}}
        C["ok"] += 1
        if not body.get("stream"):
            self._send(200, {"id": rid, "choices": [choice], **extra})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


ThreadingHTTPServer((host, port), H).serve_forever()
