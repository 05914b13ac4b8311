"""The operators' acceptance test as reusable steps: two passes of one prompt.

Pass 1 computes the prompt (the connector stores its KV); ``POST /reset_prefix_cache``
empties vLLM's GPU prefix cache so a pass-2 hit can only come from the connector; pass 2
sends the same prompt. Entry points: :func:`run_two_passes`, :func:`check_acceptance`
and one ``check_*`` per invariant (each raises ``AssertionError``). The negative control
(a KV-corrupting connector) must trip :func:`check_same_output_tokens` or
:func:`check_logprobs_agree`. See docs/tiers.md, "e2e (GPU)".
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from tvc.config.checks import MAX_LOG_LINE_CHARS
from tvc.config.profile import search_log
from tvc.procs.client import (
    EXTERNAL_HITS_METRIC,
    EXTERNAL_SOURCE_LABEL,
    PREFIX_HITS_METRIC,
    PROMPT_TOKENS_BY_SOURCE_METRIC,
    REQUEST_SUCCESS_METRIC,
    Completion,
    MetricsSnapshot,
)
from tvc.procs.polling import PollTimeout, wait_until
from tvc.procs.vllm_server import VllmServer

MAX_TOKENS = 16  # generated tokens per pass (the operators' smoke uses 16)
TOP_K = 5  # top-k logprobs compared per generated position
# Pass 2 prefills only the tokens after the hit, in a smaller batch than pass 1, so
# kernels may round differently; on a float16 model the logprobs of the same tokens
# stay within ~1e-2 nats, a corrupted KV moves them by O(1) nats.
LOGPROB_ATOL = 0.1  # nats, absolute, per token present in both passes' top-k
# Two candidates whose pass-1 logprobs are this close are a tie for greedy decoding:
# float16 logits can make them equal to the last bit (0.0000 nats seen on the GPU host
# with the tiny model); tokens and logprobs are compared up to the tie, not past it.
TIE_NATS = 0.01
PROMPT_BLOCKS_MIN = 4  # the acceptance prompt spans at least 4 KV blocks
HIT_LOG_WAIT_S = 5.0  # the engine process may write its hit line a moment later
LOG_POLL_S = 0.25  # period of re-reading a server log for an awaited line, seconds
# A log quiet this long after the requests completed holds their lines (the server
# writes unbuffered: PYTHONUNBUFFERED, vLLM's handlers flush each record).
LOG_QUIET_S = 1.0
ACCEPTANCE_PROMPT_TOKENS = 600  # the operators' prompt: 600 tokens (37.5 blocks of 16)
SEED_ENV = "TVC_SEED"
# outside a suite run (no config to hold it) one drawn seed serves the whole process
_SEED: list[tuple[int, str]] = []  # (seed, where it came from), set on first use

COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "external_hits": (EXTERNAL_HITS_METRIC, {}),
    "prefix_hits": (PREFIX_HITS_METRIC, {}),
    "external_source_tokens": (PROMPT_TOKENS_BY_SOURCE_METRIC,
                               {"source": EXTERNAL_SOURCE_LABEL}),
}


@dataclass
class PassResult:
    """One pass: the output, the counters' increases and the log it caused.

    Attributes:
        completion: the streamed completion (``ttft_s`` set).
        deltas: counter name (keys of :data:`COUNTERS`) -> increase during the pass, in
            tokens.

    """

    completion: Completion
    deltas: dict[str, float]
    log: str
    metrics_after: MetricsSnapshot


@dataclass
class TwoPassResult:
    """Both passes of one prompt.

    Attributes:
        block_size: the server's KV block size B in tokens.
        pass2: the pass after the prefix-cache reset (and restart, if asked).
        hit_log_pattern: ``connector.hit_log_pattern`` ("" when none), for
            :func:`served_tokens`.

    """

    prompt: list[int]
    block_size: int
    pass1: PassResult
    pass2: PassResult
    restarted: bool = False
    notes: list[str] = field(default_factory=list)
    hit_log_pattern: str = ""

    def properties(self, prefix: str = "") -> dict[str, Any]:
        """Figures for ``record_property`` (TTFT in s, counts in tokens)."""
        p1, p2 = self.pass1, self.pass2
        return {
            f"{prefix}prompt_tokens": len(self.prompt),
            f"{prefix}block_size": self.block_size,
            f"{prefix}ttft_pass1_s": round(p1.completion.ttft_s or 0.0, 4),
            f"{prefix}ttft_pass2_s": round(p2.completion.ttft_s or 0.0, 4),
            f"{prefix}external_hits_pass1": int(p1.deltas["external_hits"]),
            f"{prefix}external_hits_pass2": int(p2.deltas["external_hits"]),
            f"{prefix}prefix_cache_hits_pass2": int(p2.deltas["prefix_hits"]),
            f"{prefix}external_source_tokens_pass2":
                int(p2.deltas["external_source_tokens"]),
            f"{prefix}max_logprob_diff": round(max_logprob_diff(
                p1.completion, p2.completion), 6),
        }


def run_seed(seed: int | None = None, source: str = "", profile: Any = None
             ) -> tuple[int, str]:
    """The prompt seed of this run and where it came from, ``(seed, source)``.

    First match wins: ``seed`` chosen by the user (``--tvc-seed``/``TVC_SEED``), the
    profile's ``[e2e] seed`` when not 0, the run's own ``seed``
    (:attr:`tvc.plugin.session.RunState.seed`), ``TVC_SEED`` read here (outside a suite
    run), else a random 32-bit seed drawn once per process. Replay with ``--tvc-seed``.

    Raises:
        ValueError: ``TVC_SEED`` is not an integer (outside a suite run).

    """
    chosen = source in ("--tvc-seed", "TVC_SEED") or (
        source == "controller" and bool(os.environ.get(SEED_ENV, "").strip()))
    data = getattr(profile, "data", None) or {}
    profile_seed = int(data.get("e2e", {}).get("seed", 0) or 0)
    if seed is not None and chosen:
        return int(seed), source
    if profile_seed:
        return profile_seed, "[e2e] seed"
    if seed is not None:
        return int(seed), f"run seed ({source or 'default'})"
    if _SEED:
        return _SEED[0]
    if os.environ.get(SEED_ENV, "").strip():
        raw = os.environ[SEED_ENV].strip()
        try:
            drawn = int(raw, 0), SEED_ENV
        except ValueError:
            raise ValueError(f"{SEED_ENV}={raw!r}: expected an integer prompt "
                             "seed") from None
    else:
        drawn = secrets.randbits(32), "random (this run)"
    _SEED.append(drawn)
    return _SEED[0]


def rng_for(test_id: str, seed: int) -> random.Random:
    """A prompt generator seeded by the prompt seed (:func:`run_seed`) and a test id."""
    return random.Random(f"{seed}-{test_id}")


def make_prompt(rng: random.Random, length: int, lo: int, hi: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[lo, hi)``.

    Random, so a persistent store cannot answer pass 1 from an earlier run.
    """
    return [rng.randrange(lo, hi) for _ in range(length)]


def run_pass(server: VllmServer, prompt: Sequence[int],
             max_tokens: int = MAX_TOKENS, top_k: int = TOP_K) -> PassResult:
    """Send one streamed greedy request and measure what it did to the counters.

    Counters are read once vLLM counts the request finished (``vllm:request_success``).
    ``top_k`` is logprobs per generated position.
    """
    client = server.client()
    before = client.metrics()
    offset = server.log_offset()
    done = before.value(REQUEST_SUCCESS_METRIC)
    completion = client.complete_streaming(list(prompt), max_tokens=max_tokens,
                                           logprobs=top_k)
    after = client.wait_for_metric(REQUEST_SUCCESS_METRIC, done + 1)
    deltas = {k: after.value(n, **lab) - before.value(n, **lab)
              for k, (n, lab) in COUNTERS.items()}
    return PassResult(completion, deltas, server.log_text(offset), after)


def run_two_passes(server: VllmServer, prompt: Sequence[int], *,
                   restart_between: bool = False, max_tokens: int = MAX_TOKENS,
                   top_k: int = TOP_K, hit_log_pattern: str = "") -> TwoPassResult:
    """Pass 1, reset the GPU prefix cache (optionally restart the server), pass 2.

    ``restart_between`` restarts ``server`` in place (it stays running). With
    ``hit_log_pattern``, waits up to :data:`HIT_LOG_WAIT_S` for it in the pass-2 log.
    """
    block_size = server.client().block_size()
    p1 = run_pass(server, prompt, max_tokens, top_k)
    server.client().reset_prefix_cache()
    if restart_between:
        server.restart()
    offset = server.log_offset()
    p2 = run_pass(server, prompt, max_tokens, top_k)
    if hit_log_pattern:
        # no hit line in time is no error here: check_acceptance judges the log
        p2.log = await_log_line(lambda: server.log_text(offset),
                                lambda text: search_log(hit_log_pattern, text),
                                HIT_LOG_WAIT_S, f"the hit log line {hit_log_pattern!r}")
    return TwoPassResult(list(prompt), block_size, p1, p2, restart_between,
                         hit_log_pattern=hit_log_pattern)


def await_log_line(read: Callable[[], str], found: Callable[[str], object],
                   max_s: float, what: str, quiet_s: float = LOG_QUIET_S) -> str:
    """Read a server log again until a line is there or the log has settled.

    Returns the text last read when ``found`` holds, after ``quiet_s`` seconds without
    growth, or after ``max_s`` seconds.
    """
    text, since = read(), time.monotonic()

    def settled() -> bool:
        nonlocal text, since
        now_text, now = read(), time.monotonic()
        if len(now_text) != len(text):
            since = now
        text = now_text
        return bool(found(text)) or now - since >= quiet_s

    with contextlib.suppress(PollTimeout):
        wait_until(settled, max_s, LOG_POLL_S, what)
    return text


def logged_hit_tokens(pattern: str, log: str) -> int | None:
    """Tokens a connector's own hit line names, e.g. LMCache's "hit tokens: 768".

    The count is the pattern's group ``tokens``, else its first numeric group. Returns
    the largest count of the matching lines, or None (no pattern, match or numeric
    group).
    """
    if not pattern:
        return None
    try:
        compiled = regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError, ValueError):
        return None
    counts = []
    for line in log.splitlines():
        try:
            m = compiled.search(line[:MAX_LOG_LINE_CHARS], timeout=1.0)
        except TimeoutError:  # a backtracking pattern on this line: no count
            continue
        if m is None:
            continue
        group = m.groupdict().get("tokens") or (m.group(1) if m.groups() else None)
        if group is not None and group.strip().isdigit():
            counts.append(int(group))
    return max(counts) if counts else None


def served_tokens(r: TwoPassResult) -> tuple[int, str]:
    """Prompt tokens pass 2 was served by the connector, and where that was read.

    First that shows it: ``prompt_tokens_by_source{source="external_kv_transfer"}``,
    ``external_prefix_cache_hits``, the connector's hit line
    (:func:`logged_hit_tokens`). Returns ``(0, why)`` when none shows a hit.
    """
    by_source = int(r.pass2.deltas.get("external_source_tokens", 0))
    if by_source > 0:
        return by_source, (f"{PROMPT_TOKENS_BY_SOURCE_METRIC}{{source="
                           f"\"{EXTERNAL_SOURCE_LABEL}\"}}")
    hits = int(r.pass2.deltas.get("external_hits", 0))
    if hits > 0:
        return hits, EXTERNAL_HITS_METRIC
    logged = logged_hit_tokens(r.hit_log_pattern, r.pass2.log)
    if logged:
        return logged, f"the connector's log ({r.hit_log_pattern!r})"
    return 0, "neither vLLM's counters nor the connector's log show a hit"


def served_text(r: TwoPassResult) -> str:
    """``pass 2 was served 768 of 769 prompt tokens by the connector (<source>)``."""
    n, source = served_tokens(r)
    if not n:
        return f"pass 2 was served no prompt token by the connector ({source})"
    return (f"pass 2 was served {n} of {len(r.prompt)} prompt tokens by the "
            f"connector ({source})")


# ---------------------------------------------------------------------------- checks

def check_first_pass_computed(r: TwoPassResult) -> None:
    """Pass 1 must be computed, not served; AssertionError if it had external hits."""
    seen = int(r.pass1.deltas["external_hits"])
    assert seen == 0, (
        f"pass 1 of a fresh random {len(r.prompt)}-token prompt: expected 0 external "
        f"hit tokens, saw {seen} — the store answered a prompt it was never given; "
        "check the connector's hashing (a false hit) or clear the store")


def check_external_hits(r: TwoPassResult, expected: int, what: str = "") -> None:
    """The external-hit counter rose in pass 2 by exactly ``expected`` tokens.

    Raises:
        AssertionError: another count; the message names the likely cause.

    """
    seen = int(r.pass2.deltas["external_hits"])
    ctx = (f"{len(r.prompt)}-token prompt, block {r.block_size}"
           + (", server restarted between the passes" if r.restarted else ""))
    hint = ("the connector stored nothing or did not find it; check that its store "
            "is writable and that it saves on request finish" if seen == 0 else
            "the connector matched a different number of tokens than the profile's "
            "hit rule; fix the connector or the profile's connector.hit_rule")
    assert seen == expected, (
        f"{what or 'external hits after pass 2'}: expected {expected} tokens "
        f"({ctx}), saw {seen} ({EXTERNAL_HITS_METRIC}) — {hint}")


def check_no_prefix_cache_hits(r: TwoPassResult) -> None:
    """The GPU prefix cache served nothing in pass 2; AssertionError if hits rose."""
    seen = int(r.pass2.deltas["prefix_hits"])
    assert seen == 0, (
        f"GPU prefix-cache hits in pass 2: expected 0 after POST "
        f"/reset_prefix_cache, saw {seen} ({PREFIX_HITS_METRIC}) — the reset did not "
        "take effect, so pass 2 does not prove a connector hit")


def check_source_counter_agrees(r: TwoPassResult, expected: int) -> None:
    """``prompt_tokens_by_source{source="external_kv_transfer"}`` rose by ``expected``.

    Raises:
        AssertionError: another count.

    """
    seen = int(r.pass2.deltas["external_source_tokens"])
    assert seen == expected, (
        f"prompt tokens from external KV transfer in pass 2: expected {expected}, "
        f"saw {seen} ({PROMPT_TOKENS_BY_SOURCE_METRIC}{{source="
        f"\"{EXTERNAL_SOURCE_LABEL}\"}}) — the connector reported a hit but the "
        "tokens were not loaded from it (or the reverse)")


def check_hit_logged(r: TwoPassResult, pattern: str, log_path: object,
                     expected: int = 1) -> None:
    """The server log written during pass 2 matches the profile's hit pattern.

    No check with an empty ``pattern`` or ``expected`` 0 (no hit due).

    Raises:
        AssertionError: no line matches.

    """
    if not pattern or expected <= 0:
        return
    assert search_log(pattern, r.pass2.log), (
        f"server log during pass 2: expected a line matching {pattern!r} (the "
        f"profile's connector.hit_log_pattern), saw none in "
        f"{len(r.pass2.log.splitlines())} lines of {log_path} — the connector did "
        "not report its hit; check its log level or the pattern")


# --------------------------------------------------------------- output comparison
#
# As vLLM's ``check_logprobs_close`` (tests/models/utils.py), but stricter: logprobs
# always compared (``always_check_logprobs``) with a tolerance, and a divergence is
# accepted only at a tie (both tokens within TIE_NATS of the best logprob).


def _top2_gap(c: Completion, i: int) -> str:
    if i >= len(c.top_logprobs) or len(c.top_logprobs[i]) < 2:
        return "unknown"
    a, b = sorted(c.top_logprobs[i].values(), reverse=True)[:2]
    return f"{a - b:.4f}"


def _tie_in(top: dict[int, float], tokens: tuple[int, int]) -> bool:
    best = max(top.values(), default=None)
    return best is not None and all(
        t in top and best - top[t] <= TIE_NATS for t in tokens)


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where two token-id lists differ (None when identical)."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def output_diff(outputs_0: Completion, outputs_1: Completion, name_0: str,
                name_1: str, atol: float = LOGPROB_ATOL, what: str = "both",
                hint: str = "") -> str:
    """Compare two greedy outputs of the same prompt; "" when they agree.

    Token ids must be equal, except a first difference that is a tie-break (within
    :data:`TIE_NATS`); nothing past it is compared. Up to it, each top-1 is in the
    other's top-k and shared top-k logprobs agree within ``atol`` nats. ``what`` is
    ``"tokens"``, ``"logprobs"`` or ``"both"``; ``hint`` is appended to a failure.

    Returns:
        "" or one message naming the position, both sides, the values and the tolerance.

    """
    a, b = outputs_0, outputs_1
    tail = f" — {hint}" if hint else ""
    i = _first_mismatch(a.token_ids, b.token_ids)
    if what in ("tokens", "both") and i is not None:
        tie = (i < min(len(a.top_logprobs), len(b.top_logprobs),
                       len(a.token_ids), len(b.token_ids))
               and any(_tie_in(top[i], (a.token_ids[i], b.token_ids[i]))
                       for top in (a.top_logprobs, b.top_logprobs)))
        if not tie:
            same = (f"{i} identical output token(s) before it "
                    f"({list(a.token_ids[:i])})" if i else
                    "no identical output token before it")
            return (f"output token ids differ between {name_0} and {name_1} at "
                    f"position {i}: {same}; "
                    f"{name_0}: {list(a.token_ids[i:])}, {name_1}: "
                    f"{list(b.token_ids[i:])} ({name_0}'s top-2 logprob gap "
                    f"there: {_top2_gap(a, i)} nats, not a tie){tail}")
    if what == "tokens":
        return ""
    if not (len(a.top_logprobs) > 0 and len(b.top_logprobs) > 0):
        return (f"logprobs: expected top-k logprobs per generated position from "
                f"both {name_0} and {name_1}, saw {len(a.top_logprobs)} and "
                f"{len(b.top_logprobs)} positions — the server did not return "
                "logprobs; check it accepts `logprobs` in /v1/completions")
    n = min(len(a.top_logprobs), len(b.top_logprobs))
    if i is not None:
        n = min(n, i + 1)  # up to and including the (tie-break) difference
    for k in range(n):
        da, db = a.top_logprobs[k], b.top_logprobs[k]
        top_a, top_b = max(da, key=da.__getitem__), max(db, key=db.__getitem__)
        if top_a not in db or top_b not in da:
            return (f"logprobs at position {k}: {name_0}'s top-{len(da)} {da} and "
                    f"{name_1}'s {db} do not share their top tokens{tail}")
        for t in sorted(da.keys() & db.keys()):
            diff = abs(da[t] - db[t])
            if diff > atol:
                return (f"logprob of token {t} at position {k}: {name_0} "
                        f"{da[t]:.4f}, {name_1} {db[t]:.4f}, |diff| {diff:.4f} > "
                        f"tolerance {atol} nats{tail}")
    return ""


LOAD_HINT = ("the KV the connector loaded is not the KV pass 1 computed; check the "
             "connector's load path (layout, block order, dtype)")


def comparable_positions(r: TwoPassResult) -> int:
    """How many generated positions of the two passes condition on equal histories.

    All when the token ids match; up to and including a tie-break difference.

    Raises:
        AssertionError: a difference that is not a tie (shows pass 1's top-2 gap there).

    """
    a, b = r.pass1.completion, r.pass2.completion
    msg = output_diff(a, b, "pass 1", "pass 2", what="tokens", hint=LOAD_HINT)
    if msg:
        raise AssertionError(f"{msg} ({served_text(r)})")
    i = _first_mismatch(a.token_ids, b.token_ids)
    return len(a.token_ids) if i is None else i + 1


def check_same_output_tokens(r: TwoPassResult) -> None:
    """Greedy output token ids of both passes are identical (up to an exact tie).

    Raises:
        AssertionError: they differ other than by a tie-break.

    """
    comparable_positions(r)


def max_logprob_diff(a: Completion, b: Completion) -> float:
    """Largest |logprob difference| (nats) over tokens in both top-k lists, else 0.0."""
    worst = 0.0
    n = min(len(a.top_logprobs), len(b.top_logprobs))
    for i in range(n):
        shared = a.top_logprobs[i].keys() & b.top_logprobs[i].keys()
        for t in shared:
            worst = max(worst, abs(a.top_logprobs[i][t] - b.top_logprobs[i][t]))
    return worst


def check_logprobs_agree(r: TwoPassResult, atol: float = LOGPROB_ATOL) -> None:
    """Top-k logprobs of both passes agree within ``atol`` nats, position by position.

    Up to and including the first (tie-break) difference; each top-1 must be in the
    other's top-k.

    Raises:
        AssertionError: a difference above ``atol``, or disjoint top-k lists.

    """
    msg = output_diff(r.pass1.completion, r.pass2.completion, "pass 1", "pass 2",
                      atol, what="logprobs",
                      hint="the KV the connector loaded differs from what pass 1 "
                           "computed")
    if msg:
        raise AssertionError(f"{msg} ({served_text(r)})")


BASELINE_NAME = "baseline (no connector)"


def baseline_verdict(baseline: Completion, pass1: Completion | None,
                     pass2: Completion, atol: float = LOGPROB_ATOL,
                     name1: str = "connector pass 1",
                     name2: str = "connector pass 2") -> str:
    """Compare a connector server's outputs with the baseline server's; name the side.

    Only pass 2 differs: the loaded KV is wrong. Only pass 1: the connector server
    computes differently (save path writes into the KV cache, or vLLM with a connector
    runs differently). Both, agreeing: vLLM with a connector differs. Both, disagreeing:
    both. ``atol`` is ``[e2e] logprob_atol`` (nats); ``pass1`` may be None.

    Returns:
        "" when every given output agrees, else the verdict and the first difference.

    """
    d2 = output_diff(baseline, pass2, BASELINE_NAME, name2, atol)
    d1 = output_diff(baseline, pass1, BASELINE_NAME, name1, atol) if pass1 else ""
    if not d1 and not d2:
        return ""
    if d2 and not d1:
        agree = f"; {name1} agrees with the baseline" if pass1 else ""
        return (f"{name2} differs from the {BASELINE_NAME}{agree} — the KV the "
                f"connector loaded is wrong (the connector, not vLLM): {d2}")
    assert pass1 is not None
    if d1 and not d2:
        return (f"{name1} differs from the {BASELINE_NAME} while {name2} agrees "
                "with it — the connector server computed the prompt itself "
                "differently (the connector's save path changed the KV cache, or "
                f"vLLM with a connector runs differently): {d1}")
    d12 = output_diff(pass1, pass2, name1, name2, atol)
    if not d12:
        return (f"{name1} and {name2} agree with each other but both differ from "
                f"the {BASELINE_NAME} — vLLM with a kv_transfer_config computes "
                "differently from vLLM without one (not a load problem; compare "
                f"the two servers' logs for a changed setting): {d1}")
    return (f"{name1} and {name2} differ from the {BASELINE_NAME} and from each "
            f"other — both the connector server's own computation and the KV it "
            f"loaded are off: {d1}; {d2}")


def check_against_baseline(r: TwoPassResult, baseline: Completion | None,
                           atol: float = LOGPROB_ATOL) -> None:
    """Both passes agree with the baseline output (None: skip; ``atol`` in nats).

    Raises:
        AssertionError: :func:`baseline_verdict`'s message.

    """
    if baseline is None:
        return
    msg = baseline_verdict(baseline, r.pass1.completion, r.pass2.completion, atol)
    if msg:
        raise AssertionError(f"{msg} ({served_text(r)})")


def check_acceptance(r: TwoPassResult, expected: int, hit_log_pattern: str,
                     log_path: object, what: str = "",
                     baseline: Completion | None = None,
                     atol: float = LOGPROB_ATOL) -> None:
    """Every acceptance invariant of one two-pass result, in order.

    Pass 1 computed; external hits == ``expected``; no GPU prefix-cache hit; by-source
    counter agrees; hit logged (if a pattern is set); identical tokens; logprobs within
    ``atol``; both passes match the baseline (when given).

    Raises:
        AssertionError: the first invariant that does not hold.

    """
    check_first_pass_computed(r)
    check_external_hits(r, expected, what)
    check_no_prefix_cache_hits(r)
    check_source_counter_agrees(r, expected)
    check_hit_logged(r, hit_log_pattern, log_path, expected)
    check_same_output_tokens(r)
    check_logprobs_agree(r, atol)
    check_against_baseline(r, baseline, atol)
