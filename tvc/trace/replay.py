"""Trace replay: Mooncake-format traces, prompt synthesis, three replay modes, figures.

Traces are the public Mooncake JSONL format (kvcache-ai/Mooncake
``FAST25-release/traces``, also read by AIPerf and Dynamo): ``timestamp`` (ms),
``input_length``, ``output_length``, ``hash_ids`` (one per 512-token block; equal ids =
equal blocks). Prompts are token ids, block ``h`` drawn from
``numpy.random.default_rng([seed, h])``. Modes (:func:`plan`): ``populate`` (each
distinct prompt once, ``max_tokens=1``, strict prefixes too: ExampleConnector matches
whole prompts only), ``interleave`` (every request, round-robin over prefix groups) and
``stream`` (at trace time x ``time_scale``). :func:`replay` measures TTFT/TPOT/e2e
p50/p90/p99 (``numpy.percentile`` linear, Hyndman & Fan type 7) and ``/metrics`` deltas.
See docs/tiers.md, "trace (GPU)".
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import requests

from tvc.config.profile import DATA_DIR
from tvc.core.files import write_file
from tvc.procs.client import (
    COMPUTE_SOURCE_LABEL,
    EXTERNAL_HITS_METRIC,
    EXTERNAL_QUERIES_METRIC,
    EXTERNAL_SOURCE_LABEL,
    LOCAL_SOURCE_LABEL,
    PREFIX_HITS_METRIC,
    PREFIX_QUERIES_METRIC,
    PROMPT_TOKENS_BY_SOURCE_METRIC,
    completion_body,
)
from tvc.procs.client import parse_metrics as parse_snapshot
from tvc.procs.client import stream_completion as client_stream

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the public Mooncake traces
SHIPPED_TRACE = DATA_DIR / "traces" / "smoke.jsonl"
MODES = ("populate", "interleave", "stream")
PERCENTILES = (50, 90, 99)
PERCENTILE_METHOD = "linear"  # numpy.percentile default; Hyndman & Fan type 7
PERCENTILE_DOC = ("numpy.percentile(method='linear'): Hyndman & Fan type 7, linear "
                  "interpolation between closest ranks")

# /metrics counters read before and after each run (sample names, summed over labels;
# prompt_tokens_by_source is also kept per source label); the names are the server
# owner's (tvc/procs/vllm_server.py, from vllm/v1/metrics/loggers.py).
METRIC_LOCAL_HITS = PREFIX_HITS_METRIC
METRIC_LOCAL_QUERIES = PREFIX_QUERIES_METRIC
METRIC_EXTERNAL_HITS = EXTERNAL_HITS_METRIC
METRIC_EXTERNAL_QUERIES = EXTERNAL_QUERIES_METRIC
METRIC_PROMPT_BY_SOURCE = PROMPT_TOKENS_BY_SOURCE_METRIC
TRACKED_METRICS = (METRIC_LOCAL_HITS, METRIC_LOCAL_QUERIES, METRIC_EXTERNAL_HITS,
                   METRIC_EXTERNAL_QUERIES, METRIC_PROMPT_BY_SOURCE)
# where a prompt token's KV came from (vllm/v1/metrics/stats.py PromptTokenStats):
# the GPU prefix cache, the connector (external), or the model (computed)
TOKEN_SOURCES = (LOCAL_SOURCE_LABEL, EXTERNAL_SOURCE_LABEL, COMPUTE_SOURCE_LABEL)
# Under pressure the GPU KV cache holds this fraction of the trace's working set
# (distinct KV blocks): an LRU cache smaller than the interleave mode's cyclic working
# set evicts every block before reuse (the suite's choice; num_gpu_blocks_override).
PRESSURE_FRACTION = 0.5
# Evidence of pressure: baseline GPU-cache hits stay below this share of an unbounded
# cache's (the suite's choice: at least a tenth of the reuse lost to eviction).
PRESSURE_EVIDENCE = 0.9
DEFAULT_BLOCK_SIZE = 16  # vLLM's CUDA default KV block size; pressure pins it


class TraceError(ValueError):
    """A trace file or record cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class TraceRecord:
    """One request of a Mooncake-format trace.

    Attributes:
        timestamp_ms: arrival time in ms since the first request.
        input_length: prompt length in tokens (at 512 tokens per hash id).
        hash_ids: one id per 512-token block; equal ids mean equal blocks.

    """

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_record(obj: Any, index: int, where: str = "") -> TraceRecord:
    """Validate one decoded trace line (``where`` is ``file:line`` for messages).

    Raises:
        TraceError: not an object, or a field missing or of the wrong type/sign.

    """
    where = where or f"record {index}"
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")

    def num(key: str, integer: bool, default: Any = None) -> Any:
        if key not in obj:
            if default is not None:
                return default
            raise TraceError(f"{where}: missing key {key!r} (Mooncake format: "
                             "timestamp, input_length, output_length, hash_ids)")
        v = obj[key]
        ok = isinstance(v, int) if integer else isinstance(v, int | float)
        if not ok or isinstance(v, bool) or v < 0:
            kind = "a non-negative integer" if integer else "a non-negative number"
            raise TraceError(f"{where}: key {key!r}: expected {kind}, got {v!r}")
        return v

    ts = num("timestamp", integer=False, default=0)
    inp = num("input_length", integer=True)
    out = num("output_length", integer=True)
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise TraceError(f"{where}: key 'hash_ids': expected a list of non-negative "
                         f"integers, got {str(ids)[:80]}")
    if inp < 1:
        raise TraceError(f"{where}: key 'input_length': must be at least 1, got {inp}")
    return TraceRecord(index=index, timestamp_ms=float(ts), input_length=inp,
                       output_length=out, hash_ids=tuple(ids))


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Read a Mooncake-format JSONL trace (blank lines ignored), records in file order.

    Raises:
        TraceError: unreadable file, invalid JSON or an invalid record (the message
            names ``file:line``), or no record at all.

    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror}") from None
    records: list[TraceRecord] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
        records.append(parse_record(obj, len(records), f"{path}:{lineno}"))
    if not records:
        raise TraceError(f"{path}: the trace has no records")
    return records


@dataclass(frozen=True)
class PromptSynth:
    """Deterministic token-id prompts from hash ids.

    Attributes:
        tokens_per_hash_id: tokens per block (512 in Mooncake traces; smaller for a
            small model).
        token_low: smallest token id used (skips special tokens at the start).
        token_high: one past the largest token id used (at most the vocab size).
        seed: mixes into every block so two suites can use disjoint prompts.

    """

    tokens_per_hash_id: int = MOONCAKE_BLOCK_TOKENS
    token_low: int = 100
    token_high: int = 30000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_hash_id < 1:
            raise TraceError(f"tokens_per_hash_id must be >= 1, got "
                             f"{self.tokens_per_hash_id}")
        if not 0 <= self.token_low < self.token_high:
            raise TraceError(f"token range [{self.token_low}, {self.token_high}) is "
                             "empty; give token_high <= the model's vocab size")

    def block(self, hash_id: int) -> np.ndarray:
        """The token ids of one block, int64 of shape ``(tokens_per_hash_id,)``."""
        rng = np.random.default_rng([self.seed, 0x7A11, hash_id])
        return rng.integers(self.token_low, self.token_high,
                            size=self.tokens_per_hash_id, dtype=np.int64)

    def prompt_length(self, rec: TraceRecord) -> int:
        """The record's prompt length in tokens (>= 1) at this block size.

        ``round(input_length * t / 512)``, clamped into the last hash id's block
        (``(k-1)*t + 1 .. k*t`` for ``k`` hash ids) so every hash id contributes.
        """
        t = self.tokens_per_hash_id
        n = max(1, round(rec.input_length * t / MOONCAKE_BLOCK_TOKENS))
        k = len(rec.hash_ids)
        if k:
            n = min(max(n, (k - 1) * t + 1), k * t)
        return n

    def prompt(self, rec: TraceRecord) -> list[int]:
        """Token ids of the record's prompt (``prompt_length(rec)`` of them).

        A record without hash ids gets tokens unique to its index (no reuse).
        """
        n = self.prompt_length(rec)
        if not rec.hash_ids:
            rng = np.random.default_rng([self.seed, 0x5EED, rec.index])
            return rng.integers(self.token_low, self.token_high, size=n).tolist()
        blocks = [self.block(h) for h in rec.hash_ids]
        return np.concatenate(blocks)[:n].tolist()


@dataclass
class PlannedRequest:
    """One request of a replay.

    Attributes:
        send_at_s: seconds after the replay's start to send it (stream mode), or None to
            send as soon as a worker is free.
        group: the prefix group (first hash id, or -1 - index without hash ids).

    """

    record_index: int
    prompt: list[int]
    max_tokens: int
    send_at_s: float | None = None
    group: int = 0


def _group(rec: TraceRecord) -> int:
    return rec.hash_ids[0] if rec.hash_ids else -1 - rec.index


def plan(records: Sequence[TraceRecord], mode: str, synth: PromptSynth, *,
         max_output_tokens: int = 0, time_scale: float = 1.0,
         max_duration_s: float = 0.0, max_requests: int = 0,
         max_prompt_tokens: int = 0) -> list[PlannedRequest]:
    """Turn a trace into the requests of one replay mode, in send order.

    ``mode`` is ``populate``, ``interleave`` or ``stream``. Zero means "no limit" for
    ``max_output_tokens`` (at least 1 is asked), ``max_duration_s`` (stream mode: drop
    later requests), ``max_requests`` (first N records) and ``max_prompt_tokens`` (cut
    prompts). Stream mode sends at timestamp * ``time_scale``.

    Raises:
        TraceError: unknown mode or a negative time scale.

    """
    if mode not in MODES:
        raise TraceError(f"unknown replay mode {mode!r} (known: {', '.join(MODES)})")
    if time_scale < 0:
        raise TraceError(f"time_scale must be >= 0, got {time_scale}")
    recs = list(records[:max_requests] if max_requests else records)

    def out_tokens(rec: TraceRecord) -> int:
        n = rec.output_length
        if max_output_tokens:
            n = min(n, max_output_tokens)
        return max(1, n)

    def make(rec: TraceRecord, max_tokens: int,
             send_at: float | None = None) -> PlannedRequest:
        prompt = synth.prompt(rec)
        if max_prompt_tokens:
            prompt = prompt[:max_prompt_tokens]
        return PlannedRequest(rec.index, prompt, max_tokens, send_at, _group(rec))

    if mode == "populate":
        seen: OrderedDict[tuple[tuple[int, ...], int], TraceRecord] = OrderedDict()
        for rec in recs:
            key = (rec.hash_ids, synth.prompt_length(rec))
            if not rec.hash_ids:
                continue  # nothing in it can be reused
            seen.setdefault(key, rec)
        return [make(rec, 1) for rec in seen.values()]
    if mode == "interleave":
        groups: OrderedDict[int, list[TraceRecord]] = OrderedDict()
        for rec in recs:
            groups.setdefault(_group(rec), []).append(rec)
        queues = [list(g) for g in groups.values()]
        order: list[TraceRecord] = []
        while any(queues):
            for q in queues:
                if q:
                    order.append(q.pop(0))
        return [make(rec, out_tokens(rec)) for rec in order]
    t0 = min(r.timestamp_ms for r in recs)
    out = []
    for rec in sorted(recs, key=lambda r: (r.timestamp_ms, r.index)):
        at = (rec.timestamp_ms - t0) / 1000.0 * time_scale
        if max_duration_s and at > max_duration_s:
            continue
        out.append(make(rec, out_tokens(rec), at))
    return out


# ---------------------------------------------------------------------------
# Measurement


@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds).

    Attributes:
        ok: the server answered 200 and the stream ended with ``[DONE]``.
        output_tokens: tokens received (usage, else one per chunk).
        start_s: send time since the start of the replay.
        send_lag_s: stream mode: how late the send was against its trace time.
        ttft_s: time to first token (first SSE chunk carrying a choice).
        tpot_s: time per output token after the first; None for < 2 tokens.

    """

    record_index: int
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start_s: float = 0.0
    send_lag_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None


def stream_completion(session: requests.Session, base_url: str, model: str,
                      prompt: list[int], max_tokens: int, timeout_s: float = 300.0,
                      record_index: int = 0) -> RequestResult:
    """Send one streaming completion and time it.

    Through :func:`tvc.procs.client.stream_completion`, as the e2e tier.

    No logprobs are asked (they would slow the replay); ``ignore_eos`` is set.
    ``timeout_s`` is the connect/read timeout in seconds. Never raises for HTTP or
    stream errors: the result has ``ok`` False and ``error`` set.
    """
    res = RequestResult(record_index=record_index, prompt_tokens=len(prompt))
    c = client_stream(session, base_url,
                      completion_body(model, prompt, max_tokens, logprobs=None),
                      timeout_s)
    res.ttft_s = c.ttft_s
    if c.error:
        res.error = c.error
        return res
    res.e2e_s = c.latency_s
    res.output_tokens = c.output_tokens
    if res.output_tokens >= 2 and res.ttft_s is not None:
        res.tpot_s = (res.e2e_s - res.ttft_s) / (res.output_tokens - 1)
    res.ok = True
    return res


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Read the tracked prefix-cache counters from ``/metrics``.

    Returns:
        sample name -> value summed over label sets, for :data:`TRACKED_METRICS`, plus
        ``vllm:prompt_tokens_by_source_total{source="..."}`` per source; counters the
        server does not export are absent.

    Raises:
        requests.RequestException: the endpoint is unreachable or not 200.

    """
    resp = requests.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text into the tracked counters (see :func:`scrape_metrics`)."""
    snap = parse_snapshot(text)
    out = {name: snap.value(name) for name in TRACKED_METRICS if snap.has(name)}
    for labels in snap.labels(METRIC_PROMPT_BY_SOURCE):
        if "source" in labels:
            src = labels["source"]
            out[f'{METRIC_PROMPT_BY_SOURCE}{{source="{src}"}}'] = snap.value(
                METRIC_PROMPT_BY_SOURCE, source=src)
    return out


def metric_delta(before: Mapping[str, float], after: Mapping[str, float]
                 ) -> dict[str, float]:
    """``after - before`` for every counter in either (a missing one counts 0)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0)
            for k in sorted(set(before) | set(after))}


def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Percentiles and mean of the values (None entries left out; the unit is kept).

    Returns:
        ``{"n", "mean", "min", "max", "p50", "p90", "p99"}``; figures None when no value
        is given. Percentiles per :data:`PERCENTILE_DOC`.

    """
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, float | int | None] = {"n": int(arr.size)}
    if arr.size == 0:
        out.update({"mean": None, "min": None, "max": None,
                    **{f"p{p}": None for p in PERCENTILES}})
        return out
    pct = np.percentile(arr, PERCENTILES, method=PERCENTILE_METHOD)  # type: ignore[call-overload]
    out.update({"mean": float(arr.mean()), "min": float(arr.min()),
                "max": float(arr.max()),
                **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)}})
    return out


@dataclass
class RunResult:
    """One replay of one mode against one server.

    Attributes:
        variant: ``connector`` or ``baseline`` (server without a connector).
        wall_s: wall time from the first send to the last answer.
        metrics_before / metrics_after: the tracked counters; empty when ``/metrics``
            was unreachable.

    """

    mode: str
    variant: str
    wall_s: float
    results: list[RequestResult]
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def succeeded(self) -> list[RequestResult]:
        """The requests that completed."""
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> list[RequestResult]:
        """The requests that did not complete."""
        return [r for r in self.results if not r.ok]

    def delta(self) -> dict[str, float]:
        """Counter deltas over the run."""
        return metric_delta(self.metrics_before, self.metrics_after)

    def figures(self) -> dict[str, Any]:
        """The run as a JSON-ready dict (figures, config, per-request rows)."""
        ok = self.succeeded
        wall = self.wall_s if self.wall_s > 0 else float("nan")
        out_tok = sum(r.output_tokens for r in ok)
        in_tok = sum(r.prompt_tokens for r in ok)
        d = self.delta()
        return {
            "mode": self.mode, "variant": self.variant, "config": self.config,
            "requests": len(self.results), "succeeded": len(ok),
            "failed": len(self.failed),
            "errors": sorted({r.error for r in self.failed})[:5],
            "wall_s": round(self.wall_s, 4),
            "throughput": {
                "requests_per_s": _finite(len(ok) / wall),
                "output_tokens_per_s": _finite(out_tok / wall),
                "prompt_tokens_per_s": _finite(in_tok / wall),
            },
            "ttft_s": summarize(r.ttft_s for r in ok),
            "tpot_s": summarize(r.tpot_s for r in ok),
            "e2e_s": summarize(r.e2e_s for r in ok),
            "send_lag_s": summarize(r.send_lag_s for r in ok),
            "percentile_method": PERCENTILE_DOC,
            "prefix_cache": {
                "local_hit_tokens": d.get(METRIC_LOCAL_HITS),
                "local_query_tokens": d.get(METRIC_LOCAL_QUERIES),
                "external_hit_tokens": d.get(METRIC_EXTERNAL_HITS),
                "external_query_tokens": d.get(METRIC_EXTERNAL_QUERIES),
            },
            "token_sources": token_sources(
                d, sum(r.prompt_tokens for r in self.results)),
            "metrics_delta": d,
            "notes": self.notes,
            "per_request": [asdict(r) for r in self.results],
        }


def _finite(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else round(x, 4)


def replay(base_url: str, model: str, planned: Sequence[PlannedRequest], *,
           mode: str, variant: str, concurrency: int = 4, timeout_s: float = 300.0,
           config: Mapping[str, Any] | None = None) -> RunResult:
    """Send the planned requests with at most ``concurrency`` (>= 1) worker threads.

    Stream-mode requests go at ``send_at_s`` after the start, others as soon as a worker
    is free; ``/metrics`` is read before and after. ``timeout_s`` is per request (s).
    """
    local = threading.local()

    def sess() -> requests.Session:
        if not hasattr(local, "s"):
            local.s = requests.Session()
        return local.s

    def metrics() -> dict[str, float]:
        try:
            return scrape_metrics(base_url)
        except requests.RequestException:
            return {}

    before = metrics()
    t_start = time.perf_counter()

    def one(p: PlannedRequest) -> RequestResult:
        start = time.perf_counter() - t_start
        r = stream_completion(sess(), base_url, model, p.prompt, p.max_tokens,
                              timeout_s, p.record_index)
        r.start_s = start
        if p.send_at_s is not None:
            r.send_lag_s = max(0.0, start - p.send_at_s)
        return r

    with ThreadPoolExecutor(max_workers=max(1, concurrency),
                            thread_name_prefix="trace") as pool:
        futures = []
        for p in planned:
            if p.send_at_s is not None:
                wait = p.send_at_s - (time.perf_counter() - t_start)
                if wait > 0:
                    time.sleep(wait)
            futures.append(pool.submit(one, p))
        results = [f.result() for f in futures]
    wall = time.perf_counter() - t_start
    return RunResult(mode=mode, variant=variant, wall_s=wall, results=results,
                     metrics_before=before, metrics_after=metrics(),
                     config=dict(config or {}))


def source_metric_key(source: str) -> str:
    """The :func:`parse_metrics` key of one ``prompt_tokens_by_source`` source."""
    return f'{METRIC_PROMPT_BY_SOURCE}{{source="{source}"}}'


def token_sources(delta: Mapping[str, float], prompt_tokens_sent: int
                  ) -> dict[str, Any]:
    """Where the prompt tokens of a run came from: GPU cache, connector, compute.

    From ``vllm:prompt_tokens_by_source`` (local_cache_hit + external_kv_transfer +
    local_compute = prompt tokens, vLLM 0.26 and 0.28) when all three are exported; else
    the hit counters, compute = ``prompt_tokens_sent`` minus both (clamped at 0).
    Returns ``{"method", "total_tokens", "tokens", "fractions"}`` over
    :data:`TOKEN_SOURCES`; fractions sum to 1 when total > 0.
    """
    keys = {src: source_metric_key(src) for src in TOKEN_SOURCES}
    if all(k in delta for k in keys.values()):
        tokens = {src: max(0.0, float(delta[k])) for src, k in keys.items()}
        method = f"{METRIC_PROMPT_BY_SOURCE} deltas"
    else:
        local = max(0.0, float(delta.get(METRIC_LOCAL_HITS, 0.0)))
        ext = max(0.0, float(delta.get(METRIC_EXTERNAL_HITS, 0.0)))
        tokens = {LOCAL_SOURCE_LABEL: local, EXTERNAL_SOURCE_LABEL: ext,
                  COMPUTE_SOURCE_LABEL: max(0.0, prompt_tokens_sent - local - ext)}
        method = ("hit counter deltas; local_compute = prompt tokens sent minus "
                  "hits")
    total = sum(tokens.values())
    return {"method": method, "total_tokens": total, "tokens": tokens,
            "fractions": {src: (round(n / total, 6) if total else None)
                          for src, n in tokens.items()}}


def throughput_gain(baseline: Mapping[str, Any], connector: Mapping[str, Any]
                    ) -> dict[str, float | None]:
    """Throughput of the connector run over the baseline's (> 1: the connector wins).

    Returns:
        ``{"requests_per_s": ratio, "output_tokens_per_s": ratio}``; None where a figure
        is missing or zero.

    """
    out: dict[str, float | None] = {}
    for key in ("requests_per_s", "output_tokens_per_s"):
        b = baseline["throughput"].get(key)
        c = connector["throughput"].get(key)
        out[key] = round(c / b, 4) if b and c else None
    return out


def working_set_blocks(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """Distinct KV blocks the prompts need, counting shared prefixes once.

    Blocks are identified as vLLM's prefix cache does (tokens + hash chain of the blocks
    before); a prompt's last partial block counts too.

    Raises:
        ValueError: ``block_size`` < 1.

    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    for prompt in prompts:
        h = 0
        for k in range(0, len(prompt), block_size):
            h = hash((h, tuple(prompt[k:k + block_size])))
            seen.add(h)
    return len(seen)


def ideal_local_hits(prompts: Iterable[Sequence[int]], block_size: int) -> int:
    """GPU prefix-cache hit tokens an unbounded cache would serve, prompts in order.

    Per prompt: the longest prefix of full blocks seen in an earlier prompt, at most
    ``(len - 1) // B`` blocks (vLLM always recomputes the last prompt token), times B.
    """
    seen: set[int] = set()
    hits = 0
    for prompt in prompts:
        chain, h = [], 0
        for k in range(len(prompt) // block_size):
            h = hash((h, tuple(prompt[k * block_size:(k + 1) * block_size])))
            chain.append(h)
        cap = (len(prompt) - 1) // block_size
        n = 0
        while n < cap and chain[n] in seen:
            n += 1
        hits += n * block_size
        seen.update(chain)
    return hits


def pressure_plan(prompts: Sequence[Sequence[int]], block_size: int,
                  max_model_len: int, fraction: float = PRESSURE_FRACTION,
                  override: int = 0) -> dict[str, Any]:
    """Size the GPU KV cache below the trace's working set.

    ``num_gpu_blocks = max(ceil(max_model_len / B) + 1, ceil(fraction x working set))``;
    vLLM refuses to start when the cache cannot hold one ``--max-model-len`` request
    (``_check_enough_kv_cache_memory``, vllm/v1/core/kv_cache_utils.py, 0.26 and 0.28,
    applied after ``num_gpu_blocks_override``). An ``override`` > 0 wins. The result's
    ``under_pressure`` is False when the cache still holds the whole working set.

    Raises:
        ValueError: a fraction outside (0, 1) or a non-positive block size.

    """
    if not 0 < fraction < 1:
        raise ValueError(f"pressure fraction must be in (0, 1), got {fraction}")
    ws = working_set_blocks(prompts, block_size)
    floor = -(-max_model_len // block_size) + 1
    if override > 0:
        blocks, source = override, "[trace] num_gpu_blocks_override"
    else:
        blocks = max(floor, math.ceil(fraction * ws))
        source = f"max(ceil({fraction} x working set), ceil(max_model_len / B) + 1)"
    return {"working_set_blocks": ws, "floor_blocks": floor,
            "num_gpu_blocks": blocks, "fraction": fraction,
            "block_size": block_size, "max_model_len": max_model_len,
            "source": source, "under_pressure": blocks < ws}


def ttft_gain(baseline: Mapping[str, Any], connector: Mapping[str, Any]
              ) -> dict[str, float | None]:
    """TTFT gain of the connector over the baseline, per percentile.

    Returns:
        ``{"p50": baseline/connector TTFT, ...}`` (> 1: the connector is faster) and
        ``"p50_reduction_pct"`` etc. (100 * (1 - connector/baseline)); None where a
        figure is missing or zero.

    """
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        b = baseline["ttft_s"].get(f"p{p}")
        c = connector["ttft_s"].get(f"p{p}")
        ok = bool(b) and bool(c)
        out[f"p{p}"] = round(b / c, 4) if ok else None
        out[f"p{p}_reduction_pct"] = round(100 * (1 - c / b), 2) if ok else None
    return out


# ---------------------------------------------------------------------------
# Checks (each raises AssertionError with its message when the property fails)


def check_all_succeeded(fig: Mapping[str, Any]) -> None:
    """Every request of a run completed."""
    if fig["requests"] == 0:
        raise AssertionError(
            f"{fig['variant']} {fig['mode']}: the replay sent no request; the "
            "trace is empty after max_requests/max_duration_s — widen them")
    if fig["failed"]:
        raise AssertionError(
            f"{fig['variant']} {fig['mode']}: expected all {fig['requests']} "
            f"requests to complete, {fig['failed']} failed; first errors: "
            f"{'; '.join(fig['errors'])} — check the server log in the run folder")


def check_percentiles_ordered(fig: Mapping[str, Any]) -> None:
    """Min <= p50 <= p90 <= p99 <= max for TTFT, TPOT and end-to-end latency."""
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        s = fig[key]
        seq = [s.get("min"), s.get("p50"), s.get("p90"), s.get("p99"), s.get("max")]
        if None in seq:
            continue
        if any(a > b + 1e-12 for a, b in zip(seq, seq[1:], strict=False)):
            raise AssertionError(
                f"{fig['variant']} {fig['mode']}: {key} percentiles out of "
                f"order: min/p50/p90/p99/max = {seq}; expected non-decreasing — "
                "the percentile computation is broken")
        if seq[0] < 0:
            raise AssertionError(
                f"{fig['variant']} {fig['mode']}: {key} has a "
                f"negative time {seq[0]}")
    s = fig["ttft_s"]
    e = fig["e2e_s"]
    if s.get("max") is not None and e.get("max") is not None and s["max"] > e["max"]:
        raise AssertionError(
            f"{fig['variant']} {fig['mode']}: max TTFT {s['max']:.4f} s exceeds "
            f"max end-to-end latency {e['max']:.4f} s; the timing is broken")


def check_external_hits_rose(fig: Mapping[str, Any]) -> None:
    """The connector's store served prompt tokens (external prefix-cache hits > 0)."""
    hits = fig["prefix_cache"].get("external_hit_tokens")
    if hits is None:
        raise AssertionError(
            f"{fig['variant']} {fig['mode']}: the server exports no "
            f"{METRIC_EXTERNAL_HITS} counter; expected it to rise — is /metrics "
            "enabled and the server a vLLM V1 engine with a KV connector?")
    if hits <= 0:
        raise AssertionError(
            f"{fig['variant']} {fig['mode']}: expected external prefix-cache hits "
            f"to rise after populate and a local cache reset, saw "
            f"{METRIC_EXTERNAL_HITS} +{hits:g} (local hits "
            f"+{fig['prefix_cache'].get('local_hit_tokens') or 0:g}) — the "
            "connector stored or found nothing; check its store path and log")


def check_no_external_hits(fig: Mapping[str, Any]) -> None:
    """A server without a connector reports no external hits (baseline sanity)."""
    hits = fig["prefix_cache"].get("external_hit_tokens") or 0
    if hits > 0:
        raise AssertionError(
            f"{fig['variant']} {fig['mode']}: the baseline server (no "
            f"--kv-transfer-config) reported {hits:g} external hit tokens; "
            "expected 0 — the baseline is not a connector-free server")


def check_pressure(baseline: Mapping[str, Any], connector: Mapping[str, Any]) -> None:
    """Under GPU cache pressure the connector served prompt tokens the GPU lost.

    Same mode of both variants: the connector served tokens; the baseline's GPU hits
    stay below :data:`PRESSURE_EVIDENCE` of :func:`ideal_local_hits` (when recorded);
    and the connector run computed a smaller share of prompt tokens.

    Raises:
        AssertionError: it does not hold (the message says which part and why).

    """
    fb = baseline["token_sources"]["fractions"]
    fc = connector["token_sources"]["fractions"]
    mode = connector["mode"]
    if fc[EXTERNAL_SOURCE_LABEL] in (None, 0) or fb[LOCAL_SOURCE_LABEL] is None:
        raise AssertionError(
            f"pressure, {mode}: expected the connector to serve prompt tokens "
            f"the GPU cache evicted, saw connector fractions {fc} — nothing was "
            "loaded from the store; check its capacity ([connector] "
            "extra_config) against the trace's working set")
    ideal = baseline.get("config", {}).get("ideal_local_hit_tokens")
    kept = baseline["token_sources"]["tokens"][LOCAL_SOURCE_LABEL]
    if ideal and kept >= PRESSURE_EVIDENCE * ideal:
        raise AssertionError(
            f"pressure, {mode}: the baseline's GPU prefix cache served {kept:g} "
            f"of the {ideal:g} prompt tokens an unbounded cache would have "
            f"(>= {PRESSURE_EVIDENCE:g}) — the GPU cache was not under "
            "pressure, nothing the connector loaded had to be recomputed "
            "without it; lower [trace] num_gpu_blocks_override")
    saved_b = fb[LOCAL_SOURCE_LABEL]
    saved_c = fc[LOCAL_SOURCE_LABEL] + fc[EXTERNAL_SOURCE_LABEL]
    if saved_c <= saved_b + 1e-6:  # fractions are rounded to 6 digits
        raise AssertionError(
            f"pressure, {mode}: expected the connector run to compute less "
            f"than the baseline (not computed: connector {saved_c:.3f} = GPU "
            f"{fc[LOCAL_SOURCE_LABEL]:.3f} + store "
            f"{fc[EXTERNAL_SOURCE_LABEL]:.3f}, baseline {saved_b:.3f}) — the "
            "GPU cache was not under pressure; lower [trace] "
            "num_gpu_blocks_override")


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON, creating the parent folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file(path, json.dumps(data, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------
# The shipped smoke trace


def generate_trace(seed: int = 0, n_requests: int = 40, n_docs: int = 5,
                   rate_per_s: float = 4.0, repeat_prob: float = 0.35,
                   prefix_blocks: tuple[int, int] = (8, 12),
                   question_blocks: tuple[int, int] = (1, 3),
                   output_tokens: tuple[int, int] = (16, 128)) -> list[dict[str, Any]]:
    """Generate a Mooncake-format trace with shared prefixes, from a seed.

    ``n_docs`` documents own a prefix of ``prefix_blocks`` 512-token blocks; requests
    pick a document (weights 1/(rank+1)), repeat an earlier one with ``repeat_prob``,
    else add ``question_blocks`` new blocks; Poisson arrivals at ``rate_per_s``
    (requests/s). Only ``random.Random.random`` is used, so output is stable across
    Python 3 versions. Ranges are inclusive ``(low, high)`` tuples.

    Returns:
        the records as dicts in Mooncake key order.

    """
    import random

    r = random.Random(seed)

    def rint(lo: int, hi: int) -> int:
        return lo + int(r.random() * (hi - lo + 1))

    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    docs = [new_ids(rint(*prefix_blocks)) for _ in range(n_docs)]
    weights = [1.0 / (i + 1) for i in range(n_docs)]
    total_w = sum(weights)
    asked: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n_docs)}
    out: list[dict[str, Any]] = []
    t_ms = 0.0
    for i in range(n_requests):
        if i:
            t_ms += -math.log(1.0 - r.random()) / rate_per_s * 1000.0
        x, d = r.random() * total_w, 0
        while x > weights[d] and d < n_docs - 1:
            x -= weights[d]
            d += 1
        if asked[d] and r.random() < repeat_prob:
            prev = asked[d][int(r.random() * len(asked[d]))]
            rec = {**prev, "timestamp": int(t_ms)}
        else:
            ids = docs[d] + new_ids(rint(*question_blocks))
            length = (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + rint(
                1, MOONCAKE_BLOCK_TOKENS)
            rec = {"timestamp": int(t_ms), "input_length": length,
                   "output_length": rint(*output_tokens), "hash_ids": ids}
            asked[d].append(rec)
        out.append(rec)
    return out


def dump_trace(records: Iterable[Mapping[str, Any]]) -> str:
    """Records as JSONL text (one compact object per line, trailing newline)."""
    return "".join(json.dumps(dict(rec), separators=(", ", ": ")) + "\n"
                   for rec in records)


# ---------------------------------------------------------------------------
# The gain with its uncertainty, and the connector's effective load rate

BOOTSTRAP_RESAMPLES = 4000  # resamples of the request set (percentile bootstrap)
GAIN_CONFIDENCE = 0.95  # two-sided level of the interval on the TTFT gain
# Fewest requests per variant for a ratio of medians to be decided: below this the
# bootstrap's interval is itself unreliable (a median of < 8 values moves by whole
# requests); the run then says the sample is too small instead of passing.
MIN_GAIN_SAMPLE = 8


def _ttfts(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], float]:
    """(repeat, record_index) -> TTFT (s) of every succeeded request of ``runs``."""
    out: dict[tuple[int, int], float] = {}
    for rep, fig in enumerate(runs):
        for r in fig.get("per_request", []):
            if r.get("ok") and r.get("ttft_s") is not None:
                out[rep, int(r["record_index"])] = float(r["ttft_s"])
    return out


def ttft_gain_interval(baseline_runs: Sequence[Mapping[str, Any]],
                       connector_runs: Sequence[Mapping[str, Any]], seed: int = 0,
                       resamples: int = BOOTSTRAP_RESAMPLES,
                       confidence: float = GAIN_CONFIDENCE) -> dict[str, Any]:
    """The p50 TTFT gain (baseline / connector) with a paired bootstrap interval.

    Requests are paired by (repeat, record index) and resampled together; unpaired
    (failed on one side) ones are left out. ``confidence`` is two-sided.

    Returns:
        ``{"p50", "low", "high", "confidence", "n", "repeats", "resamples", "seed",
        "method"}``; ``p50``/``low``/``high`` None when no pair exists.

    """
    b, c = _ttfts(baseline_runs), _ttfts(connector_runs)
    keys = sorted(set(b) & set(c))
    out: dict[str, Any] = {
        "p50": None, "low": None, "high": None, "confidence": confidence,
        "n": len(keys), "repeats": min(len(baseline_runs), len(connector_runs)),
        "resamples": resamples, "seed": seed,
        "method": ("paired percentile bootstrap over requests (same trace record "
                   "and repeat on both variants) of median(baseline TTFT) / "
                   "median(connector TTFT)")}
    if not keys:
        return out
    bv = np.array([b[k] for k in keys])
    cv = np.array([c[k] for k in keys])
    if float(np.median(cv)) <= 0:
        return out
    out["p50"] = round(float(np.median(bv) / np.median(cv)), 4)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(keys), size=(resamples, len(keys)))
    den = np.median(cv[idx], axis=1)
    ratios = np.median(bv[idx], axis=1) / np.where(den > 0, den, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size:
        alpha = (1 - confidence) / 2
        lo, hi = np.quantile(ratios, [alpha, 1 - alpha])  # type: ignore[misc]
        out["low"], out["high"] = round(float(lo), 4), round(float(hi), 4)  # type: ignore[has-type]
    return out


def gain_verdict(interval: Mapping[str, Any], need: float,
                 min_sample: int = MIN_GAIN_SAMPLE) -> tuple[str, str]:
    """Whether the TTFT gain's interval clears ``need``.

    ``pass`` when low >= need, ``fail`` when high < need, ``undecided`` when it
    straddles, ``too_small`` with fewer than ``min_sample`` pairs (or no interval).

    Returns:
        (verdict, sentence stating the figures).

    """
    n, lo, hi, p50 = (interval.get(k) for k in ("n", "low", "high", "p50"))
    conf = f"{100 * interval.get('confidence', GAIN_CONFIDENCE):.0f}%"
    if not n or n < min_sample or lo is None or hi is None:
        return "too_small", (
            f"the sample is too small to decide: {n or 0} paired requests "
            f"(at least {min_sample} needed for an interval on a median ratio)")
    text = (f"interleave TTFT p50 gain {p50}x, {conf} interval [{lo}, {hi}] over "
            f"{n} paired requests ({interval.get('repeats', 1)} repeat(s))")
    if lo >= need:
        return "pass", f"{text} clears {need:g}x"
    if hi < need:
        return "fail", f"{text}: below {need:g}x"
    return "undecided", f"{text} straddles {need:g}x: the run cannot tell"


def _union_s(spans: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kv_load_rate(fig: Mapping[str, Any], bytes_per_token: int) -> dict[str, Any]:
    """The connector's effective KV load rate over one run (a lower bound).

    Bytes = ``external_kv_transfer`` tokens (:func:`token_sources`) x KV bytes per
    token; seconds = union of ``[start, start + TTFT]`` (also holds prefill and
    queueing).

    Returns:
        ``{"loaded_tokens", "loaded_bytes", "load_window_s", "gbps", "method"}`` (GB/s =
        1e9 B/s; ``gbps`` None when nothing was loaded).

    """
    tokens = float((fig.get("token_sources") or {}).get("tokens", {}).get(
        EXTERNAL_SOURCE_LABEL, 0.0))
    window = _union_s((float(r["start_s"]), float(r["start_s"]) + float(r["ttft_s"]))
                      for r in fig.get("per_request", [])
                      if r.get("ok") and r.get("ttft_s") is not None)
    nbytes = tokens * bytes_per_token
    return {"loaded_tokens": tokens, "loaded_bytes": nbytes,
            "load_window_s": round(window, 4),
            "gbps": (float(f"{nbytes / window / 1e9:.4g}") if tokens and window
                     else None),
            "method": ("external_kv_transfer tokens x KV bytes per token / wall "
                       "time with a request before its first token (lower bound)")}
