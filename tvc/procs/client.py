"""The one HTTP client for a running vLLM OpenAI-compatible server.

Used by the e2e and trace tiers and the fixtures. :func:`stream_completion` is the one
SSE parser; it never raises for HTTP, transport or ``{"error": ...}`` events: the
:class:`Completion`'s ``error`` says what happened. :class:`VllmClient` wraps it for
callers that want exceptions.

vLLM's stream (``vllm/entrypoints/openai/completion/serving.py``, 0.26.0 and 0.28.0):
``data:`` events with ``choices[0]``, a ``choices: []`` event with ``usage``, then
``data: [DONE]``. Finish reason ``error`` (a KV load failure under the ``fail`` policy)
raises ``GenerationError`` in the server: streamed, one ``data: {"error": {"message":
"Internal server error", "type": "InternalServerError", "code": 500}}`` event and
``[DONE]``; not streamed, an HTTP 500 with that body. Metric names: the ``*_METRIC``
constants (``vllm/v1/metrics/loggers.py``, 0.26.0 and 0.28.0; counters get ``_total``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from tvc.procs.polling import PollTimeout, wait_until

# --- metric sample names (vllm/v1/metrics/loggers.py, same in 0.26.0 and 0.28.0) ---
EXTERNAL_HITS_METRIC = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES_METRIC = "vllm:external_prefix_cache_queries_total"
PREFIX_HITS_METRIC = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES_METRIC = "vllm:prefix_cache_queries_total"
PROMPT_TOKENS_BY_SOURCE_METRIC = "vllm:prompt_tokens_by_source_total"
# source labels of PROMPT_TOKENS_BY_SOURCE_METRIC (vllm/v1/metrics/stats.py
# PromptTokenStats.ALL_SOURCES): computed + local + external = prompt tokens
EXTERNAL_SOURCE_LABEL = "external_kv_transfer"
LOCAL_SOURCE_LABEL = "local_cache_hit"
COMPUTE_SOURCE_LABEL = "local_compute"
REQUEST_SUCCESS_METRIC = "vllm:request_success_total"
CACHE_CONFIG_INFO_METRIC = "vllm:cache_config_info"  # gauge; labels = CacheConfig
METRIC_POLL_S = 0.2  # /metrics polling period of wait_for_metric, seconds
RESET_POLL_S = 0.5  # retry period of a refused POST /reset_prefix_cache, seconds
# vllm/v1/spec_decode/metrics.py (0.26.0 and 0.28.0)
SPEC_DRAFT_TOKENS_METRIC = "vllm:spec_decode_num_draft_tokens_total"

_TOKEN_ID_PREFIX = "token_id:"  # vLLM's key with return_tokens_as_token_ids


class ServerError(RuntimeError):
    """The server could not be started, died, left processes behind, or misbehaved."""


# --------------------------------------------------------------------------- metrics

@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape of ``/metrics``.

    Attributes:
        samples: (sample name, labels, value) triples, e.g.
            ``("vllm:prefix_cache_hits_total", {"model_name": "m", "engine": "0"},
            592.0)``.
        text: the raw exposition text.

    """

    samples: tuple[tuple[str, dict[str, str], float], ...]
    text: str = ""

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``.

        0.0 when no sample matches (use :meth:`has` to tell apart).
        """
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == w for k, w in labels.items()))

    def has(self, name: str, **labels: str) -> bool:
        """Whether any sample called ``name`` with these labels exists."""
        return any(n == name and all(lab.get(k) == w for k, w in labels.items())
                   for n, lab, _ in self.samples)

    def labels(self, name: str) -> list[dict[str, str]]:
        """Return the label sets of every sample called ``name``."""
        return [dict(lab) for n, lab, _ in self.samples if n == name]


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse ``GET /metrics`` text with ``prometheus_client.parser``.

    Raises:
        ValueError: the text is not valid exposition format.

    """
    samples = tuple((s.name, dict(s.labels), float(s.value))
                    for fam in text_string_to_metric_families(text)
                    for s in fam.samples)
    return MetricsSnapshot(samples=samples, text=text)


# ------------------------------------------------------------------------ completions

@dataclass
class Completion:
    """One completion's output (choice 0), streamed or not.

    Attributes:
        token_logprobs / top_logprobs: natural-log logprob of each token; per position
            token id -> logprob of the top-k (plus the sampled token).
        ttft_s: seconds from sending to the first event carrying a token (streaming
            only; else None).
        latency_s: seconds from sending to the end of the response.
        error: "" when the request completed; else one line: ``HTTP 500: ...``, ``stream
            error: ...``, ``finish_reason error``, a transport error, or a stream that
            ended without ``[DONE]`` or without a token.
        status_code: the HTTP status (0 when no response arrived).

    """

    token_ids: list[int]
    text: str
    token_logprobs: list[float | None]
    top_logprobs: list[dict[int, float]]
    prompt_token_ids: list[int] | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str = ""
    status_code: int = 0
    events: int = 0

    @property
    def ok(self) -> bool:
        """Whether the request completed without any error."""
        return not self.error

    @property
    def output_tokens(self) -> int:
        """Generated tokens: ``usage.completion_tokens``, else ids, else events."""
        n = self.usage.get("completion_tokens")
        if isinstance(n, int):
            return n
        return len(self.token_ids) or self.events


def _tok(key: str) -> int:
    if not key.startswith(_TOKEN_ID_PREFIX):
        raise ValueError(f"logprob key {key!r} is not of the form 'token_id:N'")
    return int(key[len(_TOKEN_ID_PREFIX):])


class _Accumulator:
    """Collects the choice-0 fields of a response or of stream events."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.logprob_tokens: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] = {}
        self.finish_reason: str | None = None

    def add(self, body: Mapping[str, Any]) -> bool:
        """Add one body; return whether it carried a generated token."""
        if body.get("usage"):
            self.usage = dict(body["usage"])
        choices = body.get("choices") or []
        if not choices:
            return False
        c = choices[0]
        text = c.get("text") or ""
        self.text += text
        if c.get("finish_reason"):
            self.finish_reason = str(c["finish_reason"])
        if c.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(c["prompt_token_ids"])
        new = list(c.get("token_ids") or [])
        self.token_ids += new
        lp = c.get("logprobs") or {}
        self.token_logprobs += list(lp.get("token_logprobs") or [])
        self.top_logprobs += [{_tok(k): float(v) for k, v in (d or {}).items()}
                              for d in lp.get("top_logprobs") or []]
        toks = [_tok(t) for t in lp.get("tokens") or []]
        self.logprob_tokens += toks
        return bool(new or toks or text)

    def result(self, **kw: Any) -> Completion:
        ids = self.token_ids or self.logprob_tokens
        return Completion(token_ids=ids, text=self.text,
                          token_logprobs=self.token_logprobs,
                          top_logprobs=self.top_logprobs,
                          prompt_token_ids=self.prompt_token_ids,
                          usage=self.usage, finish_reason=self.finish_reason, **kw)


def completion_body(model: str, prompt: Sequence[int] | str, max_tokens: int,
                    logprobs: int | None = 5, **extra: Any) -> dict[str, Any]:
    """The ``/v1/completions`` body every tier sends: greedy, exactly N tokens.

    ``prompt`` token ids are sent as-is (no special tokens added); ``ignore_eos`` is
    set; ``logprobs`` is k of the top-k (None: none; keys then ``token_id:N``);
    ``extra`` fields override the defaults.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
        "max_tokens": max_tokens,
        "temperature": 0.0,  # greedy
        "ignore_eos": True,  # always max_tokens tokens, comparable across runs
        "return_token_ids": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
        body["return_tokens_as_token_ids"] = True  # logprob keys "token_id:N"
    body.update(extra)
    return body


def stream_completion(session: requests.Session, base_url: str,
                      body: Mapping[str, Any], timeout_s: float = 300.0) -> Completion:
    """Send one streamed completion and read it to the end; never raises for errors.

    TTFT is measured client-side, from just before sending to the first event carrying a
    generated token. ``stream`` and ``stream_options.include_usage`` are set here;
    ``timeout_s`` is the connect/read timeout in seconds.

    Returns:
        the :class:`Completion`; ``error`` is "" only for a 200 whose stream carried a
        token, no error event, no ``error`` finish reason, and ended with ``data:
        [DONE]``.

    """
    body = {**body, "stream": True}
    body.setdefault("stream_options", {"include_usage": True})
    acc = _Accumulator()
    ttft: float | None = None
    events = 0
    done = False
    error = ""
    status = 0
    last: list[str] = []  # the stream's last events, for the message
    t0 = time.perf_counter()
    try:
        with session.post(f"{base_url.rstrip('/')}/v1/completions", json=body,
                          stream=True, timeout=timeout_s) as resp:
            status = resp.status_code
            if status != 200:
                error = f"HTTP {status}: {resp.text[:500]}"
            else:
                for raw in resp.iter_lines(chunk_size=None):  # type: ignore[call-overload]
                    line = (raw.decode("utf-8", "replace")
                            if isinstance(raw, bytes) else raw).strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    last = [*last[-2:], data[:300]]
                    if data == "[DONE]":
                        done = True
                        break
                    msg = json.loads(data)
                    if isinstance(msg, dict) and msg.get("error"):
                        error = f"stream error: {json.dumps(msg['error'])[:500]}"
                        continue  # vLLM still sends [DONE] after it
                    if acc.add(msg):
                        events += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    except (requests.RequestException, json.JSONDecodeError, ValueError,
            OSError) as exc:
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    latency = time.perf_counter() - t0
    if not error:
        if not done:
            error = ("the stream ended without data: [DONE]; its last events: "
                     f"{last or 'none'}")
        elif acc.finish_reason == "error":
            error = "finish_reason error (the server ended the request with an error)"
        elif ttft is None:
            error = f"the stream carried no token; its last events: {last or 'none'}"
    return acc.result(ttft_s=ttft, latency_s=latency, error=error,
                      status_code=status, events=events)


class VllmClient:
    """HTTP client for one vLLM OpenAI-compatible server.

    ``base_url`` has no trailing slash; ``model`` defaults to the first of ``GET
    /v1/models``; ``timeout_s`` is per request, in seconds.
    """

    def __init__(self, base_url: str, model: str | None = None,
                 timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._model = model
        self.timeout_s = timeout_s
        self.session = requests.Session()

    @property
    def model(self) -> str:
        """The served model name (asked of ``/v1/models`` once)."""
        if self._model is None:
            r = self.session.get(f"{self.base_url}/v1/models", timeout=self.timeout_s)
            r.raise_for_status()
            self._model = r.json()["data"][0]["id"]
        return self._model

    def complete(self, prompt: Sequence[int] | str, max_tokens: int = 16,
                 logprobs: int = 5, **extra: Any) -> Completion:
        """Greedy completion (temperature 0) with top-k logprobs and token ids.

        Exactly ``max_tokens`` tokens (EOS ignored); ``ttft_s`` is None.

        Raises:
            requests.HTTPError: an error status; the message carries the server's error
                body.

        """
        t0 = time.perf_counter()
        r = self.session.post(
            f"{self.base_url}/v1/completions",
            json=completion_body(self.model, prompt, max_tokens, logprobs, **extra),
            timeout=self.timeout_s)
        raise_for_status(r)
        acc = _Accumulator()
        acc.add(r.json())
        return acc.result(latency_s=time.perf_counter() - t0, status_code=200)

    def stream(self, prompt: Sequence[int] | str, max_tokens: int = 16,
               logprobs: int | None = 5, **extra: Any) -> Completion:
        """Streamed greedy completion; errors are returned in ``Completion.error``."""
        body = completion_body(self.model, prompt, max_tokens, logprobs, **extra)
        return stream_completion(self.session, self.base_url, body, self.timeout_s)

    def complete_streaming(self, prompt: Sequence[int] | str, max_tokens: int = 16,
                           logprobs: int = 5, **extra: Any) -> Completion:
        """Like :meth:`complete`, streamed, with ``ttft_s`` (seconds) set.

        Raises:
            requests.HTTPError: error status (the message has the server's body).
            ServerError: an error event, a ``finish_reason`` of ``error``, a transport
                error, or a stream without a token or without ``[DONE]``.

        """
        c = self.stream(prompt, max_tokens, logprobs, **extra)
        if c.error.startswith("HTTP "):
            raise requests.HTTPError(f"POST {self.base_url}/v1/completions answered "
                                     f"{c.error}")
        if c.error:
            raise ServerError(f"stream from {self.base_url}: {c.error}")
        return c

    def ttft(self, prompt: Sequence[int] | str, **extra: Any) -> float:
        """Time to first token in seconds of one streamed one-token request."""
        extra.setdefault("max_tokens", 1)
        return self.complete_streaming(prompt, **extra).ttft_s or 0.0

    def health(self, timeout_s: float = 5.0) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            return self.session.get(f"{self.base_url}/health",
                                    timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def metrics(self) -> MetricsSnapshot:
        """Scrape and parse ``GET /metrics``."""
        r = self.session.get(f"{self.base_url}/metrics", timeout=self.timeout_s)
        raise_for_status(r)
        return parse_metrics(r.text)

    def wait_for_metric(self, name: str, at_least: float, timeout_s: float = 30.0,
                        **labels: str) -> MetricsSnapshot:
        """Poll ``/metrics`` until a sample sum reaches ``at_least``; return it.

        vLLM updates counters after the response may be sent; waiting for
        ``REQUEST_SUCCESS_METRIC`` makes the snapshot include all a request caused.

        Raises:
            ServerError: not reached within ``timeout_s`` seconds.

        """
        seen: list[MetricsSnapshot] = []

        def reached() -> MetricsSnapshot | None:
            snap = self.metrics()
            seen[:] = [snap]
            return snap if snap.value(name, **labels) >= at_least else None

        try:
            return wait_until(reached, timeout_s, METRIC_POLL_S,
                              f"metric {name} to reach {at_least}")
        except PollTimeout:
            raise ServerError(
                f"metric {name}{labels or ''} stayed at "
                f"{seen[0].value(name, **labels)} < {at_least} for {timeout_s} s"
                ) from None

    def reset_prefix_cache(self, reset_external: bool = False,
                           timeout_s: float = 60.0) -> None:
        """``POST /reset_prefix_cache`` until it reports success.

        vLLM refuses (``{"success": false}``) while blocks are held, e.g. by async KV
        offload transfers in flight, so this retries for ``timeout_s`` seconds.
        ``reset_external`` also asks the connector to drop its cache.

        Raises:
            ServerError: the endpoint is missing (server not in dev mode) or the reset
                never succeeded.

        """
        params = {"reset_external": "true"} if reset_external else None

        def reset() -> bool:
            r = self.session.post(f"{self.base_url}/reset_prefix_cache",
                                  params=params, timeout=self.timeout_s)
            if r.status_code == 404:
                raise ServerError(
                    "POST /reset_prefix_cache answered 404: the server runs without "
                    "VLLM_SERVER_DEV_MODE=1; start it through VllmServer")
            raise_for_status(r)
            try:
                return bool(r.json().get("success", True))
            except ValueError:
                return True  # older servers answer 200 with an empty body

        try:
            wait_until(reset, timeout_s, RESET_POLL_S,
                       "POST /reset_prefix_cache to succeed")
        except PollTimeout:
            raise ServerError(
                f"POST /reset_prefix_cache kept answering success=false for "
                f"{timeout_s} s: blocks are still held (running requests or "
                "in-flight KV transfers)") from None

    def block_size(self) -> int:
        """Return the KV block size in tokens, from ``vllm:cache_config_info``'s labels.

        Raises:
            ServerError: the metric or its ``block_size`` label is absent.

        """
        for lab in self.metrics().labels(CACHE_CONFIG_INFO_METRIC):
            if lab.get("block_size", "").isdigit():
                return int(lab["block_size"])
        raise ServerError(
            f"{self.base_url}/metrics has no {CACHE_CONFIG_INFO_METRIC} with a "
            "block_size label; pass --block-size in the profile's vllm.serve_args")


def raise_for_status(r: requests.Response) -> None:
    """Raise ``requests.HTTPError`` carrying the server's error body (>= 400)."""
    if r.status_code >= 400:
        raise requests.HTTPError(
            f"{r.request.method} {r.url} answered {r.status_code}: {r.text[:2000]}",
            response=r)
