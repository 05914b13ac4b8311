"""The e2e tier's plan: its prompts, the baseline, concurrency, load failures, variants.

Baseline: a server without ``--kv-transfer-config`` answers every prompt of the run's
:class:`PromptBook` (a pure function of seed, token range, B and profile) before any
connector server starts; :func:`tvc.e2e.two_pass.baseline_verdict` compares against it.

Concurrency: N requests at once after a store pass and a prefix-cache reset. vLLM asks
the connector only for tokens after the local hit (``get_num_new_matched_tokens(request,
num_computed_tokens)``), so a request's cached tokens are ``max(local hit, rule)``; the
plan picks L with ``rule(L) == (L - 1) // B * B`` and group prefixes P <= ``rule(L)`` so
that equals ``rule(L)``. Per wave, ``local_cache_hit + external_kv_transfer`` rises by
exactly ``N x rule(L)``.

Load failures (``tvc.contract.faults`` ``fail_load``, per ``kv_load_failure_policy`` and
async scheduling on/off) and engine :data:`VARIANTS`: see docs/tiers.md, "e2e (GPU)".
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tvc.e2e import two_pass as tp
from tvc.procs.client import (
    EXTERNAL_HITS_METRIC,
    EXTERNAL_SOURCE_LABEL,
    LOCAL_SOURCE_LABEL,
    PROMPT_TOKENS_BY_SOURCE_METRIC,
    REQUEST_SUCCESS_METRIC,
    Completion,
    MetricsSnapshot,
    ServerError,
    completion_body,
    stream_completion,
)

DEFAULT_CONCURRENCY = 16  # [e2e] concurrency default (the profile schema's)
DEFAULT_LOGPROB_ATOL = tp.LOGPROB_ATOL  # [e2e] logprob_atol default
BOUNDARY_BLOCKS = 4  # boundary prompts at 4*B - 1, 4*B, 4*B + 1
# [e2e] boundary_repeats default (the profile schema's): several fresh prompts per
# boundary length, so a fault striking only some prompts has several chances to show
DEFAULT_BOUNDARY_REPEATS = 3
# A concurrency wave: a quarter of the requests are identical twins of others, the
# rest come in groups of three sharing a prefix (the suite's choice: several groups,
# each with siblings, at N = 16: 4 twins, 4 groups of 3).
TWIN_SHARE = 4
GROUP_SIZE = 3
LENGTH_SEARCH_UNITS = 4  # search L over 4 units (of max(B, granularity)) at most
LOAD_FAILURE_CASES: tuple[tuple[str, bool], ...] = (
    ("recompute", True), ("recompute", False), ("fail", True), ("fail", False))
# vLLM's scheduler log lines (vllm/v1/core/sched/scheduler.py _handle_invalid_blocks,
# identical in 0.26.0 and 0.28.0)
RECOVERED_LOG = r"Recovered from KV load failure"
FAILING_LOG = r"Failing \d+ request\(s\) due to KV load failure"
LOAD_FAILURE_LOG_WAIT_S = 5.0
# tvc.procs.client's error for such a stream
EMPTY_STREAM = "the stream carried no token"
# /health is polled this many times, this far apart, after the failed load: an engine
# that dies on the failure takes a moment to take the API server down
HEALTH_CHECKS_AFTER = 4
HEALTH_CHECK_INTERVAL_S = 0.5


def case_id(policy: str, async_scheduling: bool) -> str:
    """Test id of one load-failure case, e.g. ``recompute-async``."""
    return f"{policy}-{'async' if async_scheduling else 'sync'}"


def e2e_setting(profile: Any, key: str, default: Any) -> Any:
    """A key of the profile's ``[e2e]`` section, or ``default`` when absent or None."""
    value = profile.data.get("e2e", {}).get(key, default)
    return default if value is None else value


# ------------------------------------------------------------------------ the prompts

@dataclass
class ConcurrencyPlan:
    """One concurrency wave (see the module docstring); lengths in tokens.

    Attributes:
        length / shared_prefix: L and P (0 = no shared prefix).
        requests: prompt names in send order (twins repeat a name).
        rule_tokens: the hit rule at L; ``expected_cached`` = ``len(requests) *
            rule_tokens``.
        min_external: the conservative lower bound on external hits.

    """

    length: int
    shared_prefix: int
    requests: list[str]
    distinct: list[str]
    twins: bool
    rule_tokens: int
    expected_cached: int
    min_external: int
    notes: list[str] = field(default_factory=list)


@dataclass
class PromptBook:
    """Every prompt the e2e tier sends, by name, from the run seed.

    ``seed`` is :func:`tvc.e2e.two_pass.run_seed`'s; ``token_range`` is ``[lo, hi)``;
    ``block_size`` B is the baseline's (checked on the others); ``rule`` maps a prompt
    length to the hit rule at B; ``granularity`` is tokens per stored unit (B by
    default).
    """

    seed: int
    token_range: tuple[int, int]
    block_size: int
    prompt_tokens: int = tp.ACCEPTANCE_PROMPT_TOKENS
    concurrency: int = DEFAULT_CONCURRENCY
    boundary_repeats: int = DEFAULT_BOUNDARY_REPEATS
    rule: Callable[[int], int] = lambda n: 0
    granularity: int = 0
    _cache: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.granularity <= 0:
            self.granularity = self.block_size
        lo, hi = self.token_range
        if hi - lo < 2:
            raise ValueError(f"token range [{lo}, {hi}) is too small for prompts")

    # -- building blocks ------------------------------------------------------------
    def random_tokens(self, key: str, n: int) -> list[int]:
        """``n`` token ids drawn from ``random.Random(f"{seed}-{key}")``."""
        rng = random.Random(f"{self.seed}-{key}")
        lo, hi = self.token_range
        return [rng.randrange(lo, hi) for _ in range(n)]

    def repetitive_tokens(self, key: str, n: int) -> list[int]:
        """``n`` tokens: a seeded permutation of the token range, repeated.

        Every id of ``[lo, hi)`` occurs (when ``n >= hi - lo``), so an n-gram proposer
        with ``prompt_lookup_min = 1`` finds any generated token in the context.
        """
        lo, hi = self.token_range
        unit = list(range(lo, hi))
        random.Random(f"{self.seed}-{key}").shuffle(unit)
        return (unit * (n // len(unit) + 1))[:n]

    # -- the catalogue ------------------------------------------------------------
    def prompts(self) -> dict[str, list[int]]:
        """Every named prompt of the e2e tier (the baseline phase sends all).

        Returns:
            name -> token ids; names: ``acceptance``, ``false-hit-stored``,
            ``false-hit-unrelated``, ``false-hit-first-token-changed``,
            ``boundary-kB-1|kB|kB+1`` (and ``-r<i>`` repeats), ``restart``,
            ``local-then-external``, ``concurrency-<i>``, ``load-failure-<case>`` and
            ``load-failure-<case>-after``.

        """
        if self._cache:
            return dict(self._cache)
        n, b = self.prompt_tokens, self.block_size
        out: dict[str, list[int]] = {
            "acceptance": self.random_tokens("acceptance", n),
            "false-hit-stored": self.random_tokens("false-hit-stored", n),
            "false-hit-unrelated": self.random_tokens("false-hit-unrelated", n),
            "restart": self.random_tokens("restart", n),
            "local-then-external": self.random_tokens("local-then-external", n),
        }
        stored = out["false-hit-stored"]
        lo, hi = self.token_range
        out["false-hit-first-token-changed"] = [
            lo + (stored[0] - lo + 1) % (hi - lo), *stored[1:]]
        for off, tag in ((-1, "kB-1"), (0, "kB"), (1, "kB+1")):
            for key in self.boundary_keys(tag):
                out[key] = self.random_tokens(key, BOUNDARY_BLOCKS * b + off)
        out.update(self._concurrency_prompts())
        for policy, asy in LOAD_FAILURE_CASES:
            cid = case_id(policy, asy)
            out[f"load-failure-{cid}"] = self.random_tokens(f"lf-{cid}", n)
            out[f"load-failure-{cid}-after"] = self.random_tokens(f"lf-{cid}-a", n)
        self._cache.update(out)
        return dict(out)

    def boundary_keys(self, tag: str) -> list[str]:
        """Names of the fresh prompts of one boundary length.

        ``tag`` is ``kB-1``, ``kB`` or ``kB+1``; returns

        ``boundary-<tag>``, then ``boundary-<tag>-r1`` ... up to
        :attr:`boundary_repeats` names.
        """
        return [f"boundary-{tag}" + (f"-r{i}" if i else "")
                for i in range(max(1, self.boundary_repeats))]

    def local_blocks(self) -> int:
        """Blocks of ``local-then-external`` that vLLM's GPU prefix cache holds.

        An odd number (off any chunk grid of two blocks or more), about half the prompt,
        leaving at least two blocks after it.

        Raises:
            ValueError: the prompt has fewer than 3 blocks (``[e2e] prompt_tokens`` too
                small).

        """
        blocks = self.prompt_tokens // self.block_size
        if blocks < 3:
            raise ValueError(f"[e2e] prompt_tokens = {self.prompt_tokens} is fewer "
                             f"than 3 blocks of {self.block_size}: no room for a "
                             "local part and an external part")
        return min(max(1, blocks // 2) | 1, blocks - 2)

    def get(self, name: str) -> list[int]:
        """One named prompt; KeyError if not in :meth:`prompts` (a suite bug)."""
        book = self.prompts()
        if name not in book:
            raise KeyError(f"no e2e prompt named {name!r} (known: "
                           f"{', '.join(sorted(book))})")
        return list(book[name])

    # -- concurrency ------------------------------------------------------------------
    def pick_length(self) -> tuple[int, bool]:
        """L for the concurrency wave and whether twins are safe at it.

        Returns:
            the smallest L >= ``prompt_tokens`` with ``rule(L) > 0`` and ``rule(L) == (L
            - 1) // B * B`` within :data:`LENGTH_SEARCH_UNITS` units, and True; else
            (``prompt_tokens``, False).

        """
        b = self.block_size
        unit = max(b, self.granularity)
        for n in range(self.prompt_tokens,
                       self.prompt_tokens + LENGTH_SEARCH_UNITS * unit + 1):
            r = self.rule(n)
            if r > 0 and r == (n - 1) // b * b:
                return n, True
        return self.prompt_tokens, False

    def concurrency_plan(self) -> ConcurrencyPlan:
        """The wave's requests and the hit sums they imply (module docstring)."""
        b, n_req = self.block_size, max(1, self.concurrency)
        length, twins = self.pick_length()
        rule = self.rule(length)
        unit = math.lcm(b, self.granularity)
        prefix = min(length // 2, rule) // unit * unit
        n_twins = n_req // TWIN_SHARE if twins and n_req > 1 else 0
        n_distinct = n_req - n_twins
        distinct = [f"concurrency-{i}" for i in range(n_distinct)]
        n_groups = max(1, math.ceil(n_distinct / GROUP_SIZE))
        requests: list[str] = []
        for i, name in enumerate(distinct):
            requests.append(name)
            if i < n_twins:
                requests.append(name)  # its identical twin, sent in the same wave
        group_of = {name: i % n_groups for i, name in enumerate(distinct)}
        group_size = {g: sum(1 for v in group_of.values() if v == g)
                      for g in range(n_groups)}
        full = (length - 1) // b * b
        min_external = 0
        seen: set[str] = set()
        for name in requests:
            if name in seen:
                shared = full  # the second of two twins: the first may cache it all
            elif prefix and group_size[group_of[name]] > 1:
                shared = prefix  # a sibling may have cached the shared prefix
            else:
                shared = 0
            seen.add(name)
            min_external += max(0, rule - shared)
        notes = []
        if not twins:
            notes.append(
                f"no identical requests: no length in [{self.prompt_tokens}, "
                f"{self.prompt_tokens + LENGTH_SEARCH_UNITS * max(b, self.granularity)}"
                "] has rule(L) == (L - 1) // B * B, so a twin's GPU-cache hit could "
                "exceed the hit rule")
        return ConcurrencyPlan(length=length, shared_prefix=prefix,
                               requests=requests, distinct=distinct, twins=twins,
                               rule_tokens=rule, expected_cached=n_req * rule,
                               min_external=min_external, notes=notes)

    def _concurrency_prompts(self) -> dict[str, list[int]]:
        plan = self.concurrency_plan()
        n_groups = max(1, math.ceil(len(plan.distinct) / GROUP_SIZE))
        prefixes = [self.random_tokens(f"concurrency-prefix-{g}", plan.shared_prefix)
                    for g in range(n_groups)]
        out = {}
        for i, name in enumerate(plan.distinct):
            suffix = self.random_tokens(name, plan.length - plan.shared_prefix)
            out[name] = prefixes[i % n_groups] + suffix
        return out


def prompt_book(profile: Any, block_size: int, token_range: tuple[int, int],
                seed: int | None = None) -> PromptBook:
    """The run's :class:`PromptBook` for ``profile`` at block size B.

    ``token_range`` is ``[lo, hi)`` from :func:`tvc.env.model.prompt_token_range`;
    ``seed`` defaults to :func:`tvc.e2e.two_pass.run_seed` outside a suite run.
    Granularity comes from ``Profile.granularity_tokens``.
    """
    gran = int(profile.granularity_tokens(block_size))
    return PromptBook(
        seed=tp.run_seed()[0] if seed is None else seed, token_range=token_range,
        block_size=block_size,
        prompt_tokens=int(e2e_setting(profile, "prompt_tokens",
                                      tp.ACCEPTANCE_PROMPT_TOKENS)),
        concurrency=int(e2e_setting(profile, "concurrency", DEFAULT_CONCURRENCY)),
        boundary_repeats=int(e2e_setting(profile, "boundary_repeats",
                                         DEFAULT_BOUNDARY_REPEATS)),
        rule=lambda n: int(profile.expected_hit_tokens(n, block_size)),
        granularity=gran)


# ------------------------------------------------------------------------ baseline

@dataclass
class Baseline:
    """The baseline server's outputs for every prompt of a :class:`PromptBook`.

    Attributes:
        outputs: prompt name -> the baseline output.
        seconds: wall time of the phase (start, prompts, stop).

    """

    book: PromptBook
    outputs: dict[str, Completion]
    argv: list[str] = field(default_factory=list)
    log_path: str = ""
    seconds: float = 0.0

    def get(self, name: str) -> Completion:
        """The baseline output of one prompt; KeyError if the phase did not send it."""
        if name not in self.outputs:
            raise KeyError(f"the baseline phase has no output for prompt {name!r}")
        return self.outputs[name]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready record of the phase (seed, B, prompts' lengths, outputs)."""
        return {
            "seed": self.book.seed, "block_size": self.book.block_size,
            "argv": self.argv, "log": self.log_path,
            "seconds": round(self.seconds, 2),
            "outputs": {name: {"prompt_tokens": len(self.book.get(name)),
                               "token_ids": c.token_ids,
                               "top_logprobs": [{str(k): v for k, v in d.items()}
                                                for d in c.top_logprobs]}
                        for name, c in self.outputs.items()},
        }


def collect_baseline(client: Any, prompts: Mapping[str, Sequence[int]],
                     max_tokens: int = tp.MAX_TOKENS, top_k: int = tp.TOP_K
                     ) -> dict[str, Completion]:
    """Send every prompt to the baseline server, one at a time, from a cold cache.

    Each prompt follows a ``POST /reset_prefix_cache`` (no reuse between prompts).
    ``top_k`` is logprobs per position.

    Raises:
        ServerError: a request failed (the message names the prompt).

    """
    out: dict[str, Completion] = {}
    for name, prompt in prompts.items():
        client.reset_prefix_cache()
        c = client.stream(list(prompt), max_tokens, top_k)
        if c.error:
            raise ServerError(f"baseline server, prompt {name!r} ({len(prompt)} "
                              f"tokens): {c.error}")
        out[name] = c
    return out


def write_baseline(path: Path, baseline: Baseline) -> Path:
    """Write :meth:`Baseline.to_json` to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(baseline.to_json(), indent=1) + "\n")
    return path


# ------------------------------------------------------------------ concurrency wave

def send_concurrently(base_url: str, model: str, prompts: Sequence[Sequence[int]],
                      max_tokens: int = tp.MAX_TOKENS, top_k: int = tp.TOP_K,
                      timeout_s: float = 300.0) -> list[Completion]:
    """Send all prompts at once (one thread and HTTP session each, a barrier).

    Returns the outputs in request order, errors in ``Completion.error``; ``timeout_s``
    is per request, in seconds.
    """
    barrier = threading.Barrier(len(prompts))

    def one(prompt: Sequence[int]) -> Completion:
        with requests.Session() as s:
            body = completion_body(model, prompt, max_tokens, top_k)
            try:
                barrier.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass
            return stream_completion(s, base_url, body, timeout_s)

    with ThreadPoolExecutor(max_workers=len(prompts),
                            thread_name_prefix="e2e-concurrent") as pool:
        return list(pool.map(one, prompts))


@dataclass
class WaveResult:
    """One concurrency wave on a connector server.

    Attributes:
        outputs: (prompt name, output) per request, in send order.
        store_outputs: the store pass's output per distinct prompt name.
        deltas: ``external_hits``, ``local_source`` and ``external_source``
            (``prompt_tokens_by_source``) over the wave, in tokens.

    """

    plan: ConcurrencyPlan
    outputs: list[tuple[str, Completion]]
    store_outputs: dict[str, Completion]
    deltas: dict[str, float]
    prompts: dict[str, list[int]] = field(default_factory=dict)


def run_wave(server: Any, book: PromptBook, max_tokens: int = tp.MAX_TOKENS,
             top_k: int = tp.TOP_K) -> WaveResult:
    """Store pass (each distinct prompt once, in turn), reset, then the wave at once.

    Counters are read once vLLM has counted every request of the wave as finished.

    Raises:
        ServerError: a store-pass request failed, or the counters never counted the
            wave.

    """
    plan = book.concurrency_plan()
    client = server.client()
    store: dict[str, Completion] = {}
    for name in plan.distinct:
        c = client.stream(book.get(name), max_tokens, top_k)
        if c.error:
            raise ServerError(f"store pass, prompt {name!r}: {c.error}")
        store[name] = c
    client.reset_prefix_cache()
    before = client.metrics()
    done = before.value(REQUEST_SUCCESS_METRIC)
    outs = send_concurrently(server.url, client.model,
                             [book.get(n) for n in plan.requests], max_tokens, top_k)
    ok = sum(1 for c in outs if c.ok)
    after = (client.wait_for_metric(REQUEST_SUCCESS_METRIC, done + ok) if ok
             else client.metrics())
    return WaveResult(plan, list(zip(plan.requests, outs, strict=True)), store,
                      _wave_deltas(before, after),
                      {n: book.get(n) for n in plan.distinct})


def _wave_deltas(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, float]:
    def d(name: str, **lab: str) -> float:
        return after.value(name, **lab) - before.value(name, **lab)

    return {
        "external_hits": d(EXTERNAL_HITS_METRIC),
        "local_source": d(PROMPT_TOKENS_BY_SOURCE_METRIC, source=LOCAL_SOURCE_LABEL),
        "external_source": d(PROMPT_TOKENS_BY_SOURCE_METRIC,
                             source=EXTERNAL_SOURCE_LABEL),
        "has_by_source": float(after.has(PROMPT_TOKENS_BY_SOURCE_METRIC)),
    }


def check_wave_outputs(w: WaveResult, baseline: Baseline | None,
                       atol: float = DEFAULT_LOGPROB_ATOL) -> None:
    """Every request of the wave completed and equals the baseline output.

    Without a baseline the store pass's output is the reference. The message names the
    requests that differ, whether the store pass already differed, whether the output is
    another prompt's, and when every differing one shares a prefix with another request
    (a load that ignores ``num_computed_tokens``).

    Raises:
        AssertionError: a failed request or a differing output.

    """
    failed = [(i, n, c.error) for i, (n, c) in enumerate(w.outputs) if c.error]
    assert not failed, (
        f"concurrency: {len(failed)} of {len(w.outputs)} requests sent at once "
        f"failed; first: request #{failed[0][0]} ({failed[0][1]}): {failed[0][2]}")
    ref_name = tp.BASELINE_NAME if baseline else "store pass (computed)"

    def ref(name: str) -> Completion:
        return baseline.get(name) if baseline else w.store_outputs[name]

    if baseline:
        for name, c in w.store_outputs.items():
            msg = tp.output_diff(ref(name), c, ref_name,
                                 f"store pass of {name} (computed, one at a time)",
                                 atol)
            assert not msg, (
                f"concurrency store pass: {msg} — the connector server computes "
                "this prompt differently from vLLM without a connector, before any "
                "concurrent load")
    wrong: list[tuple[int, str, str]] = []  # (request #, name, message)
    for i, (name, c) in enumerate(w.outputs):
        twin = " (an identical twin is in the wave)" if w.plan.requests.count(
            name) > 1 else ""
        who = f"connector, concurrent request #{i} ({name}{twin})"
        msg = tp.output_diff(ref(name), c, ref_name, who, atol)
        if msg:
            wrong.append((i, name, msg))
    if not wrong:
        return
    i, name, msg = wrong[0]
    c = w.outputs[i][1]
    other = next((o for o in w.plan.distinct if o != name
                  and not tp.output_diff(ref(o), c, "a", "b", atol)), None)
    why = (f"its output is the output of {other}: the connector served another "
           "request's KV to this one under concurrency" if other else
           "the KV loaded while several requests load at once is wrong "
           "(the same prompt alone, in the store pass, "
           + ("agreed)" if baseline else "is the reference)"))
    listed = ", ".join(f"#{j} ({n})" for j, n, _ in wrong[:8]) + (
        ", ..." if len(wrong) > 8 else "")
    shared = [_shared_with_others(w, j) for j, _, _ in wrong]
    pattern = ""
    if w.prompts and all(shared) and len(wrong) < len(w.outputs):
        pattern = (
            f"; every one of them shares its first {min(shared)}+ tokens with "
            "another request of the wave. vLLM admits concurrent requests in the "
            "order they arrive, not the order they were sent: the first of a "
            "group fills the GPU prefix cache, the others then get a GPU "
            "prefix-cache hit plus an external hit, so which requests differ can "
            "change from run to run. Check where the connector's load starts when "
            "vLLM's local cache holds part of the prompt (the num_computed_tokens "
            "that get_num_new_matched_tokens received; e2e "
            "test_local_prefix_cache_hit_then_external_hit does this alone)")
    raise AssertionError(
        f"concurrency: connector, concurrent request #{i} ({name}) differs from "
        f"the {ref_name} — {why}: {msg}. In all, {len(wrong)} of {len(w.outputs)} "
        f"requests differ: {listed}{pattern}")


def _shared_with_others(w: WaveResult, i: int) -> int:
    """Leading tokens request ``i`` shares with another one (a twin: all its tokens)."""
    mine = w.prompts.get(w.plan.requests[i], [])
    best = 0
    for j, other in enumerate(w.plan.requests):
        if j != i:
            diff = tp._first_mismatch(mine, w.prompts.get(other, []))
            best = max(best, len(mine) if diff is None else diff)
    return best


def check_wave_hits(w: WaveResult) -> None:
    """The wave's cached tokens equal the hit-rule sum; external hits in bounds.

    Raises:
        AssertionError: ``local_cache_hit + external_kv_transfer`` is not ``N x
            rule(L)``; the external counter disagrees with the by-source counter; or
            external hits fall outside ``[min_external, N x rule(L)]``.

    """
    p, d = w.plan, w.deltas
    n = len(p.requests)
    ext = int(d["external_hits"])
    assert p.min_external > 0, (
        f"concurrency plan: expected some tokens only the connector can serve, the "
        f"bound is 0 (L {p.length}, rule {p.rule_tokens}, prefix {p.shared_prefix}) "
        "— the wave would not test the connector; raise [e2e] prompt_tokens")
    if d.get("has_by_source"):
        cached = int(d["local_source"] + d["external_source"])
        assert cached == p.expected_cached, (
            f"concurrency: prompt tokens not computed (GPU prefix cache "
            f"{int(d['local_source'])} + connector {int(d['external_source'])}, "
            f"{PROMPT_TOKENS_BY_SOURCE_METRIC}) = {cached}, expected {n} requests x "
            f"hit rule {p.rule_tokens} = {p.expected_cached} (each request's cached "
            "tokens are max(GPU-cache hit, hit rule) = the hit rule at L "
            f"{p.length}) — "
            + ("some requests got fewer tokens from the store than stored: check "
               "the connector's lookup under concurrent requests" if cached <
               p.expected_cached else "some requests were served more than the "
               "hit rule allows: a false hit under concurrency"))
        assert ext == int(d["external_source"]), (
            f"concurrency: {EXTERNAL_HITS_METRIC} rose by {ext} but "
            f"prompt_tokens_by_source{{source=\"{EXTERNAL_SOURCE_LABEL}\"}} by "
            f"{int(d['external_source'])} — the connector reported matched tokens "
            "it did not load (or the reverse)")
    assert p.min_external <= ext <= p.expected_cached, (
        f"concurrency: external hit tokens {ext} ({EXTERNAL_HITS_METRIC}); expected "
        f"between {p.min_external} (tokens no other request of the wave can have "
        f"put in the GPU cache) and {p.expected_cached} ({n} x hit rule "
        f"{p.rule_tokens}) — "
        + ("the connector did not serve what it stored" if ext < p.min_external
           else "the connector matched more than its hit rule"))


# -------------------------------------------------------------------- load failures

@dataclass
class LoadFailureRun:
    """What a server with failing KV loads did with one stored prompt.

    ``pass1`` computed (and stored) it, ``pass2`` followed the prefix-cache reset (its
    load fails), ``after`` is a fresh request; ``healthy_after``: ``/health`` answered
    200 after pass 2; ``log`` is the server log from pass 2 on.
    """

    policy: str
    async_scheduling: bool
    pass1: Completion
    pass2: Completion
    after: Completion
    healthy_after: bool
    log: str
    external_hits_pass2: float = 0.0


def run_load_failure(server: Any, prompt: Sequence[int], after_prompt: Sequence[int],
                     policy: str, async_scheduling: bool,
                     max_tokens: int = tp.MAX_TOKENS, top_k: int = tp.TOP_K
                     ) -> LoadFailureRun:
    """Pass 1, reset the GPU prefix cache, pass 2 (load fails), one more request.

    ``prompt`` and ``after_prompt`` must be fresh; ``policy`` and ``async_scheduling``
    are only recorded. Request errors are recorded, not raised.
    """
    client = server.client()
    p1 = client.stream(list(prompt), max_tokens, top_k)
    client.reset_prefix_cache()
    offset = server.log_offset()
    before = client.metrics()
    p2 = client.stream(list(prompt), max_tokens, top_k)
    healthy = True
    for _ in range(HEALTH_CHECKS_AFTER):  # a crash may take a moment to show
        time.sleep(HEALTH_CHECK_INTERVAL_S)
        healthy = healthy and client.health()
    after = client.stream(list(after_prompt), max_tokens, top_k)
    pattern = re.compile(RECOVERED_LOG if policy == "recompute" else FAILING_LOG)
    # no line in time is no error here: check_load_failure judges the log
    log = tp.await_log_line(lambda: server.log_text(offset), pattern.search,
                            LOAD_FAILURE_LOG_WAIT_S,
                            f"the server log line {pattern.pattern!r}")
    try:
        ext = client.metrics().value(EXTERNAL_HITS_METRIC) - before.value(
            EXTERNAL_HITS_METRIC)
    except (requests.RequestException, ValueError):
        ext = float("nan")
    return LoadFailureRun(policy, async_scheduling, p1, p2, after, healthy, log, ext)


def check_load_failure(run: LoadFailureRun, baseline: Completion | None,
                       baseline_after: Completion | None,
                       atol: float = DEFAULT_LOGPROB_ATOL) -> None:
    """A failed KV load is handled as the policy says, and the server lives on.

    ``recompute``: pass 2 equals the baseline and vLLM logged ``Recovered from KV load
    failure``. ``fail``: pass 2 ends with a clean per-request error (error event, HTTP
    5xx with a body, or finish reason ``error``) and vLLM logged ``Failing N request(s)
    due to KV load failure``. Both: ``/health`` answers and the next request matches the
    baseline.

    Raises:
        AssertionError: the first that does not hold (names the policy and async
            setting).

    """
    tag = (f"kv_load_failure_policy={run.policy}, async scheduling "
           f"{'on' if run.async_scheduling else 'off'}")
    assert run.pass1.ok, (
        f"{tag}: pass 1 (no load yet) failed: {run.pass1.error} — the server with "
        "the fault-injecting connector does not serve at all")
    fired = re.search(RECOVERED_LOG if run.policy == "recompute" else FAILING_LOG,
                      run.log)
    if run.policy == "recompute":
        assert run.pass2.ok, (
            f"{tag}: pass 2 (its KV load fails) should be recomputed and complete, "
            f"but failed: {run.pass2.error}")
        assert fired, (
            f"{tag}: vLLM never logged {RECOVERED_LOG!r} in pass 2 — no load failure "
            "reached the scheduler (no load attempted, or the connector did not "
            "report the failed blocks through get_block_ids_with_load_errors)")
        ref = baseline or run.pass1
        name = tp.BASELINE_NAME if baseline else "pass 1"
        msg = tp.output_diff(ref, run.pass2, name,
                             "pass 2 (load failed, recomputed)", atol)
        assert not msg, (f"{tag}: {msg} — a recomputed request must give the "
                         "output of a plain computation")
    else:
        if run.pass2.ok:
            raise AssertionError(
                f"{tag}: pass 2's KV load failed but the request completed with "
                f"{len(run.pass2.token_ids)} tokens {run.pass2.token_ids[:8]}... "
                "instead of an error — under 'fail' vLLM must end the request with "
                "finish_reason error (garbage KV served as output)"
                + ("" if fired else f"; and vLLM never logged {FAILING_LOG!r}: the "
                   "connector did not report its failed load"))
        clean = (run.pass2.error.startswith(("stream error:", "HTTP 5"))
                 or run.pass2.error.startswith("finish_reason error"))
        if not clean and run.pass2.error.startswith(EMPTY_STREAM) and run.healthy_after:
            raise AssertionError(
                f"{tag}: pass 2 ended with an empty stream and no error (no token, "
                "no error event, no finish_reason error: "
                f"{run.pass2.error[len(EMPTY_STREAM):].lstrip('; ')}) — the client "
                "sees a successful, empty completion and cannot tell the request "
                "failed" + (f"; vLLM did log {FAILING_LOG!r}, so the connector "
                            "reported the load and vLLM's output path lost the "
                            "error" if fired else ""))
        assert clean, (
            f"{tag}: pass 2 failed, but not with a clean per-request error: "
            f"{run.pass2.error} — expected an error event (code 500) or HTTP 500, "
            "not a dropped connection (did the server crash?)")
        assert fired, (
            f"{tag}: pass 2 failed ({run.pass2.error}) but vLLM never logged "
            f"{FAILING_LOG!r} — it failed for another reason than the KV load")
    assert run.healthy_after, (
        f"{tag}: /health did not answer 200 after the failed load — one request's "
        "load failure took the server down")
    assert run.after.ok, (
        f"{tag}: the request after the failed load did not complete: "
        f"{run.after.error} — the server is not usable after a load failure")
    if baseline_after is not None:
        msg = tp.output_diff(baseline_after, run.after, tp.BASELINE_NAME,
                             "the request after the failed load", atol)
        assert not msg, f"{tag}: {msg}"


# ------------------------------------------------------------------ engine variants

@dataclass(frozen=True)
class EngineVariant:
    """An e2e variant: other serve args and/or another model, same checks.

    ``serve_args`` are appended to ``vllm.serve_args`` (later wins); ``model`` is
    ``"profile"`` or a key of :data:`tvc.env.model.TINY_RECIPES`; ``prompt`` is
    ``"random"`` or ``"repetitive"`` (for n-gram speculation); ``scenario_metric`` must
    rise in pass 2 to prove the feature ran ("" = none); ``doc`` is one report sentence.
    """

    name: str
    serve_args: tuple[str, ...] = ()
    model: str = "profile"
    prompt: str = "random"
    min_prompt_tokens: int = 0
    scenario_metric: str = ""
    doc: str = ""


CHUNKED_BATCH_TOKENS = 256  # --max-num-batched-tokens of the chunked-prefill variant
# n-gram speculation (vLLM's "ngram" method, 0.26 to 0.33): propose up to 3 tokens
# from the longest 1-4-gram match of the context's end (prompt_lookup_min >= 1 in
# vllm/config/speculative.py). vLLM turns async scheduling off for it, and 0.26.0
# falls back to the V1 model runner ("Model Runner V2 does not yet support ngram").
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 3,
                "prompt_lookup_max": 4, "prompt_lookup_min": 1}
VARIANTS: dict[str, EngineVariant] = {
    "sliding_window": EngineVariant(
        name="sliding_window", model="sliding-window",
        doc="tiny Llama with sliding-window attention on every other layer (Gemma-"
            "style layer_types, window 128 tokens < the prompt)"),
    "ngram_spec_decode": EngineVariant(
        name="ngram_spec_decode",
        serve_args=("--speculative-config", json.dumps(NGRAM_CONFIG)),
        prompt="repetitive", scenario_metric="vllm:spec_decode_num_draft_tokens_total",
        doc="n-gram speculative decoding (--speculative-config method ngram)"),
    "chunked_prefill": EngineVariant(
        name="chunked_prefill",
        serve_args=("--enable-chunked-prefill", "--max-num-batched-tokens",
                    str(CHUNKED_BATCH_TOKENS)),
        min_prompt_tokens=600,
        doc=f"chunked prefill: --max-num-batched-tokens {CHUNKED_BATCH_TOKENS} and a "
            "prompt longer than that"),
}


# ------------------------------------------------------------- helpers for the tests

def record_seed(record_property: Callable[[str, Any], None],
                prompt_seed: tuple[int, str]) -> None:
    """Record the prompt seed (``prompt_seed``) and its source (``..._source``).

    ``prompt_seed`` is ``(seed, source)`` from the ``tvc_prompt_seed`` fixture.
    """
    seed, source = prompt_seed
    record_property("prompt_seed", seed)
    record_property("prompt_seed_source", source)


def logprob_atol(profile: Any) -> float:
    """``[e2e] logprob_atol`` of ``profile`` (the run's ``tvc_profile``), in nats."""
    return float(e2e_setting(profile, "logprob_atol", DEFAULT_LOGPROB_ATOL))


def baseline_of(baseline: Baseline | None, name: str) -> Completion | None:
    """The baseline output of a named prompt (None without a baseline phase)."""
    return baseline.get(name) if baseline is not None else None


def check_block_size(book: PromptBook, block_size: int) -> None:
    """The connector server runs at the prompts' block size; AssertionError if not."""
    assert block_size == book.block_size, (
        f"the connector server's KV block size is {block_size}, the baseline "
        f"server's {book.block_size}: with the same serve args they must agree — "
        "the connector changed the block size; set --block-size in vllm.serve_args")


def check_two_pass(r: tp.TwoPassResult, log_path: Any,
                   baseline: Completion | None = None, what: str = "", *,
                   profile: Any) -> int:
    """Every acceptance invariant of a two-pass result against the run's profile.

    Returns the hit-rule tokens expected for the prompt.

    Raises:
        AssertionError: see :func:`tvc.e2e.two_pass.check_acceptance`.

    """
    expected = profile.expected_hit_tokens(len(r.prompt), r.block_size)
    tp.check_acceptance(r, expected, profile["connector"]["hit_log_pattern"],
                        log_path, what, baseline=baseline,
                        atol=logprob_atol(profile))
    return expected
