"""The e2e tier's plan: its prompts, the baseline, concurrency, load failures, variants.

Baseline
    One server with the profile's model and serve args but no ``--kv-transfer-config``
    (vLLM alone) answers every prompt the e2e tier will send, once per run, before
    any connector server starts (one vLLM server per GPU at a time). Its outputs are
    the reference each connector output is compared with
    (:func:`tvc.e2e.two_pass.baseline_verdict`). The prompts are a pure function of the
    run seed, the token range, the block size B and the profile
    (:class:`PromptBook`), so the baseline phase knows them all up front.

Concurrency
    N requests (``[e2e] concurrency``) sent at once after a store pass, after ``POST
    /reset_prefix_cache``. Requests scheduled in one step share vLLM's GPU prefix
    cache: a block one request allocates (its external tokens included, for a
    synchronous load) can be a local hit for the next. So which of a request's
    cached tokens come from the GPU cache and which from the connector is not
    predictable, but their sum is: vLLM asks the connector for the tokens after
    the local hit (``get_num_new_matched_tokens(request, num_computed_tokens)``), so
    a request's cached tokens are ``max(local hit, hit rule)``. The plan makes that
    equal to the hit rule for every request:

    - every prompt has one length L with ``rule(L) == (L - 1) // B * B`` (the most a
      local hit can reach: vLLM always recomputes the last prompt token), searched
      from ``[e2e] prompt_tokens`` up; when no such L is near, identical prompts are
      left out (an identical twin's local hit could exceed the rule);
    - prompts of a group share a prefix of P tokens, P a multiple of B and of the
      connector's granularity and at most ``rule(L)``, so a local hit on a sibling's
      prefix never exceeds the rule.

    Then, per wave: ``local_cache_hit + external_kv_transfer`` (vLLM's per-request
    ``prompt_tokens_by_source``) rises by exactly ``N x rule(L)``; the external-hit
    counter rises by at most that and at least the conservative bound
    ``sum(max(0, rule(L) - longest full-block prefix shared with another request))``,
    i.e. the tokens no other request in the wave can have put in the GPU cache.

Load failures
    A server whose connector is wrapped by ``tvc.contract.faults`` (mode ``fail_load``)
    for
    each ``kv_load_failure_policy`` (``recompute``, ``fail``; vLLM 0.26/0.28
    ``KVTransferConfig``) and with async scheduling on and off
    (``--async-scheduling`` / ``--no-async-scheduling``, both versions). vLLM's
    scheduler (``_handle_invalid_blocks``) logs ``Recovered from KV load failure``
    and recomputes, or logs ``Failing N request(s) due to KV load failure`` and
    finishes the request with reason ``error``, which the API server turns into a
    500 error event (see :mod:`tvc.procs.client`).

Engine variants
    :data:`VARIANTS`: a tiny sliding-window model, n-gram speculative decoding, and
    chunked prefill with a prompt longer than ``--max-num-batched-tokens``; each runs
    its own baseline and connector server, one after the other.
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
# [e2e] boundary_repeats default (the profile schema's): fresh prompts per boundary
# length, so a fault that strikes only some prompts (a race, a key collision) has
# several chances to show
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
    """A key of the profile's ``[e2e]`` section, or ``default`` when absent.

    Args:
        profile: the loaded profile.
        key: a key of ``[e2e]`` (``prompt_tokens``, ``concurrency``, ``baseline``,
            ``logprob_atol``, ``seed``...).
        default: the value for an absent or None key.

    """
    value = profile.data.get("e2e", {}).get(key, default)
    return default if value is None else value


# ------------------------------------------------------------------------ the prompts

@dataclass
class ConcurrencyPlan:
    """One concurrency wave (see the module docstring).

    Attributes:
        length: L, the prompt length of every request.
        shared_prefix: P, tokens shared by the prompts of one group (0 = none).
        requests: prompt names in send order (twins repeat a name).
        distinct: the distinct prompt names (the store pass sends these).
        twins: whether identical requests are included.
        rule_tokens: the hit rule at L (tokens a stored prompt matches).
        expected_cached: ``len(requests) * rule_tokens``.
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

    Attributes:
        seed: the run's prompt seed (:func:`tvc.e2e.two_pass.run_seed`).
        token_range: ``[lo, hi)`` token ids to draw from.
        block_size: B of the servers (the baseline's, checked on the others).
        prompt_tokens: ``[e2e] prompt_tokens`` (the acceptance prompt length).
        concurrency: ``[e2e] concurrency`` (requests per wave).
        boundary_repeats: ``[e2e] boundary_repeats`` (fresh prompts per
            boundary length, see :meth:`boundary_keys`).
        rule: tokens a stored prompt of a given length matches (the profile's hit
            rule at ``block_size``).
        granularity: tokens the connector stores per unit (B unless the profile
            says otherwise).

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

        Every id of ``[lo, hi)`` occurs (when ``n >= hi - lo``), so whatever token a
        model generates within the range, an n-gram proposer with
        ``prompt_lookup_min = 1`` finds it in the context and proposes what followed
        it. (With a 24-token pattern repeated and ``prompt_lookup_min = 2``, vLLM
        0.26.0 on the H200 proposed no draft token at all for the tiny
        random-weight model.)
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
            ``boundary-kB-1|kB|kB+1`` (and ``-r<i>`` repeats, see
            :meth:`boundary_keys`), ``restart``, ``local-then-external``,
            ``concurrency-<i>``,
            ``load-failure-<case>`` and ``load-failure-<case>-after``.

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

        Args:
            tag: ``kB-1``, ``kB`` or ``kB+1``.

        Returns:
            ``boundary-<tag>``, then ``boundary-<tag>-r1`` ... up to
            :attr:`boundary_repeats` names.

        """
        return [f"boundary-{tag}" + (f"-r{i}" if i else "")
                for i in range(max(1, self.boundary_repeats))]

    def local_blocks(self) -> int:
        """Blocks of ``local-then-external`` that vLLM's GPU prefix cache holds.

        An odd number (so the local hit ends off any chunk grid of two blocks or
        more), about half the prompt, leaving at least two blocks after it.

        Raises:
            ValueError: the prompt has fewer than 3 blocks (``[e2e]
                prompt_tokens`` too small for the test).

        """
        blocks = self.prompt_tokens // self.block_size
        if blocks < 3:
            raise ValueError(f"[e2e] prompt_tokens = {self.prompt_tokens} is fewer "
                             f"than 3 blocks of {self.block_size}: no room for a "
                             "local part and an external part")
        return min(max(1, blocks // 2) | 1, blocks - 2)

    def get(self, name: str) -> list[int]:
        """One named prompt.

        Raises:
            KeyError: the name is not in :meth:`prompts` (a suite bug).

        """
        book = self.prompts()
        if name not in book:
            raise KeyError(f"no e2e prompt named {name!r} (known: "
                           f"{', '.join(sorted(book))})")
        return list(book[name])

    # -- concurrency ------------------------------------------------------------------
    def pick_length(self) -> tuple[int, bool]:
        """L for the concurrency wave and whether twins are safe at it.

        Returns:
            the smallest L >= ``prompt_tokens`` with ``rule(L) > 0`` and
            ``rule(L) == (L - 1) // B * B`` within :data:`LENGTH_SEARCH_UNITS`
            units, and True; else (``prompt_tokens``, False).

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

    Args:
        profile: the run's :class:`tvc.config.profile.Profile`.
        block_size: B of the servers.
        token_range: ``[lo, hi)`` from :func:`tvc.env.model.prompt_token_range`.
        seed: prompt seed (``tvc_prompt_seed[0]``); default
            :func:`tvc.e2e.two_pass.run_seed` outside a suite run.

    Returns:
        the book (``[e2e] prompt_tokens`` and ``concurrency`` read with defaults;
        granularity from ``Profile.granularity_tokens``).

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
        book: the prompts.
        outputs: prompt name -> the baseline output.
        argv: the baseline server's argv.
        log_path: its log.
        seconds: wall time of the phase (start, prompts, stop).

    """

    book: PromptBook
    outputs: dict[str, Completion]
    argv: list[str] = field(default_factory=list)
    log_path: str = ""
    seconds: float = 0.0

    def get(self, name: str) -> Completion:
        """The baseline output of one prompt.

        Raises:
            KeyError: the baseline phase did not send that prompt (a suite bug).

        """
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

    Each prompt follows a ``POST /reset_prefix_cache``, so every baseline output
    is computed from the prompt alone (no prefix-cache reuse between prompts).

    Args:
        client: a :class:`tvc.procs.client.VllmClient` of the baseline server.
        prompts: name -> token ids.
        max_tokens: tokens per output (as the e2e checks ask).
        top_k: logprobs per position.

    Returns:
        name -> output.

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

    Args:
        base_url: server root.
        model: served model name.
        prompts: token-id prompts, in request order.
        max_tokens: tokens per output.
        top_k: logprobs per position.
        timeout_s: per-request timeout in seconds.

    Returns:
        the outputs in request order (errors in ``Completion.error``).

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
        plan: the wave's plan.
        outputs: (prompt name, output) per request, in send order.
        store_outputs: the store pass's output per distinct prompt name.
        deltas: ``external_hits`` (the external-hit counter), ``local_source`` and
            ``external_source`` (``prompt_tokens_by_source``) over the wave, tokens.
        prompts: token ids by prompt name.

    """

    plan: ConcurrencyPlan
    outputs: list[tuple[str, Completion]]
    store_outputs: dict[str, Completion]
    deltas: dict[str, float]
    prompts: dict[str, list[int]] = field(default_factory=dict)


def run_wave(server: Any, book: PromptBook, max_tokens: int = tp.MAX_TOKENS,
             top_k: int = tp.TOP_K) -> WaveResult:
    """Store pass (each distinct prompt once, in turn), reset, then the wave at once.

    Args:
        server: a running connector server (``client()``, ``url``).
        book: the prompts.
        max_tokens: tokens per output.
        top_k: logprobs per position.

    Returns:
        the :class:`WaveResult`; counters are read once vLLM has counted every
        request of the wave as finished.

    Raises:
        ServerError: a store-pass request failed, or the counters never counted
            the wave.

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

    Without a baseline the store pass's output of the same prompt is the reference.
    The message names the first request that differs, whether the store pass
    (computed, one request at a time) already differed, whether the wrong output
    is another prompt's (the connector served one request's KV to another), and
    every request that differs; when some are right and every one that differs
    shares a prefix with another request of the wave, it says so (a local
    prefix-cache hit plus an external hit: a connector whose load ignores
    ``num_computed_tokens``; vLLM admits them in arrival order, so which ones
    differ varies).

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
    """Leading tokens request ``i`` shares with another request of the wave.

    Returns:
        0 when none; an identical twin counts as all of its tokens.

    """
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
        AssertionError: ``local_cache_hit + external_kv_transfer`` is not
            ``N x rule(L)``; the external counter disagrees with the by-source
            counter; or external hits fall outside ``[min_external, N x rule(L)]``.

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

    Attributes:
        policy: ``kv_load_failure_policy`` of the server.
        async_scheduling: whether the server ran with ``--async-scheduling``.
        pass1: the computing pass (stores the KV).
        pass2: the pass after the prefix-cache reset (its load fails).
        after: a following request with a fresh prompt.
        healthy_after: ``/health`` answered 200 after pass 2.
        log: the server log written from pass 2 on.
        external_hits_pass2: external-hit counter increase during pass 2.

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

    Args:
        server: a running server whose connector fails its loads.
        prompt: a prompt no store has seen.
        after_prompt: another fresh prompt, sent after pass 2.
        policy: the server's ``kv_load_failure_policy`` (for the result).
        async_scheduling: the server's async scheduling (for the result).
        max_tokens: tokens per output.
        top_k: logprobs per position.

    Returns:
        the :class:`LoadFailureRun` (nothing raised for request errors).

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

    ``recompute``: pass 2 completes and equals the baseline (and pass 1); vLLM logged
    ``Recovered from KV load failure`` (the fault fired). ``fail``: pass 2 ends with
    a clean per-request error (an error event or HTTP 5xx with a body, or finish
    reason ``error``; not a dropped connection, not tokens); vLLM logged ``Failing N
    request(s) due to KV load failure``. Both: ``/health`` answers and the next
    request completes with the baseline's output.

    Raises:
        AssertionError: the first of these that does not hold; the message names
            the policy and the async-scheduling setting.

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

    Attributes:
        name: the test id.
        serve_args: appended to the profile's ``vllm.serve_args`` (later wins).
        model: ``"profile"`` (the run's model) or a key of
            :data:`tvc.env.model.TINY_RECIPES` (a built-in tiny model).
        prompt: ``"random"`` or ``"repetitive"`` (a repeated pattern, so n-gram
            speculation finds matches).
        min_prompt_tokens: the prompt is at least this long.
        scenario_metric: a counter that must rise in pass 2 to prove the variant's
            feature ran ("" = none; the other conditions are checked by the test).
        doc: one sentence for the report.

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

    Args:
        record_property: the test's ``record_property`` fixture.
        prompt_seed: ``(seed, source)`` from the ``tvc_prompt_seed`` fixture.

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
    """The connector server runs at the block size the prompts were made for.

    Raises:
        AssertionError: the sizes differ.

    """
    assert block_size == book.block_size, (
        f"the connector server's KV block size is {block_size}, the baseline "
        f"server's {book.block_size}: with the same serve args they must agree — "
        "the connector changed the block size; set --block-size in vllm.serve_args")


def check_two_pass(r: tp.TwoPassResult, log_path: Any,
                   baseline: Completion | None = None, what: str = "", *,
                   profile: Any) -> int:
    """Every acceptance invariant of a two-pass result against the run's profile.

    ``profile`` is the run's profile (``tvc_profile``): its hit rule, hit log
    pattern and ``[e2e] logprob_atol``.

    Returns:
        the hit-rule tokens expected for the prompt.

    Raises:
        AssertionError: see :func:`tvc.e2e.two_pass.check_acceptance`.

    """
    expected = profile.expected_hit_tokens(len(r.prompt), r.block_size)
    tp.check_acceptance(r, expected, profile["connector"]["hit_log_pattern"],
                        log_path, what, baseline=baseline,
                        atol=logprob_atol(profile))
    return expected
