r"""Prefill/decode (P/D) disaggregation: two servers, one router, one baseline.

A ``kv_producer`` (prefill, GPU 0) and a ``kv_consumer`` (decode, GPU 1) with the same
connector; :class:`PDRouter` sends the prefill (``max_tokens = 1``) to the producer,
then the full request to the consumer, which must get the KV from the producer. The
output must equal one engine without a connector. Entry points: :func:`pd_settings`,
:class:`PDPair`, :func:`route_prompts`. ``[pd] routing``, from vLLM's proxies:

- ``request_id``: P2pNcclConnector
  (``vllm/distributed/kv_transfer/kv_connector/v1/p2p/``, removed by
  vllm-project/vllm#44854, absent from 0.26.0). Its example proxy
  (``examples/online_serving/disaggregated_serving_p2p_nccl_xpyd/
  disagg_proxy_p2p_nccl_xpyd.py``) sends ``X-Request-Id:
  ___prefill_addr_<ip:kv_port>___decode_addr_<ip:kv_port>_<uuid>``; ``parse_request_id``
  regexes ``___decode_addr_(.*):(\d+)`` and ``___prefill_addr_(.*):(\d+)___``. The
  engine binds ``get_ip():kv_port``, so the owner sets ``VLLM_HOST_IP``.
- ``kv_transfer_params``: NixlConnector style (vLLM's ``toy_proxy_server.py``):
  ``{"do_remote_decode": true}`` in the prefill, the producer's returned params passed
  on in the decode request.
- ``shared_store``: the consumer reads the producer's store; no routing data.

Keys of ``[pd]``: docs/tiers.md, "pd (two GPUs)".
"""

from __future__ import annotations

import copy
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tvc.config.profile import Profile
from tvc.procs.client import (
    EXTERNAL_HITS_METRIC,
    REQUEST_SUCCESS_METRIC,
    Completion,
    VllmClient,
)
from tvc.procs.vllm_server import VLLM_LAUNCHER, VllmServer, free_port

__all__ = ["PDConfigError", "PDPair", "PDResult", "PDRouter", "PDSettings",
           "ROUTINGS", "build_role_configs", "check_block_sizes_match",
           "check_pd_compatible", "check_same_as_baseline", "parse_pd_request_id",
           "PDRun", "check_kv_came_from_producer", "connector_missing_reason",
           "counters", "pd_request_id", "pd_settings", "route_prompts", "serve_arg"]

ROUTINGS = ("request_id", "kv_transfer_params", "shared_store")
HOST = "127.0.0.1"  # every server of a pair runs on this machine
EXTRA = "kv_connector_extra_config"
# Tokens the router asks of the producer: 1, as vLLM's P/D proxies do (the prefill
# computes the whole prompt and samples one token).
PREFILL_MAX_TOKENS = 1
# Settings that must be equal on both sides for the consumer to use the producer's KV
# (block layout and numerics); "serve arg" -> what it is.
MUST_MATCH_ARGS = {"--block-size": "KV block size B",
                   "--dtype": "model dtype", "--kv-cache-dtype": "KV cache dtype",
                   "--max-model-len": "max model length"}


class PDConfigError(ValueError):
    """A P/D pair that cannot work; the message names the key or the check."""


@dataclass(frozen=True)
class PDSettings:
    """The profile's ``[pd]`` section with defaults (see the module docstring)."""

    enabled: bool = False
    routing: str = "shared_store"
    producer_gpu: int = 0
    consumer_gpu: int = 1
    producer: dict[str, Any] = field(default_factory=dict)
    consumer: dict[str, Any] = field(default_factory=dict)
    prefill_max_tokens: int = PREFILL_MAX_TOKENS


def pd_settings(profile: Profile) -> PDSettings:
    """Read ``[pd]`` (missing keys take the defaults of :class:`PDSettings`).

    Raises:
        PDConfigError: an unknown key, a wrong type, an unknown routing or equal GPUs;
            the message names ``pd.<key>`` and the profile file.

    """
    raw = dict(profile.data.get("pd", {}) or {})
    where = f"{profile.source}: pd"
    allowed = PDSettings.__dataclass_fields__
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise PDConfigError(f"{where}.{unknown[0]}: unknown key (allowed: "
                            f"{', '.join(allowed)})")
    types = {"enabled": bool, "routing": str, "producer_gpu": int,
             "consumer_gpu": int, "producer": dict, "consumer": dict,
             "prefill_max_tokens": int}
    for key, typ in types.items():
        if key in raw and (not isinstance(raw[key], typ) or (
                typ is int and isinstance(raw[key], bool))):
            raise PDConfigError(f"{where}.{key}: expected {typ.__name__}, got "
                                f"{raw[key]!r}")
    s = PDSettings(**raw)
    if s.routing not in ROUTINGS:
        raise PDConfigError(f"{where}.routing: {s.routing!r} is not one of "
                            f"{', '.join(ROUTINGS)}")
    if s.producer_gpu == s.consumer_gpu:
        raise PDConfigError(f"{where}.producer_gpu and consumer_gpu are both "
                            f"{s.producer_gpu}: a P/D pair needs one GPU per server")
    if s.prefill_max_tokens < 1:
        raise PDConfigError(f"{where}.prefill_max_tokens: must be >= 1")
    return s


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if k == EXTRA and isinstance(v, Mapping):
            out[EXTRA] = {**dict(out.get(EXTRA) or {}), **copy.deepcopy(dict(v))}
        else:
            out[k] = copy.deepcopy(v)
    return out


def build_role_configs(base: Mapping[str, Any], settings: PDSettings, *,
                       producer_kv_port: int, consumer_kv_port: int,
                       host: str = HOST) -> dict[str, dict[str, Any]]:
    """The producer's and the consumer's ``--kv-transfer-config``.

    ``base`` is the profile's ``kv_transfer_config()``; ``host`` is ``kv_ip`` of both.

    Returns:
        ``{"producer": {...}, "consumer": {...}}``: ``kv_role``, ``kv_rank`` 0 / 1,
        ``kv_parallel_size`` 2, ``kv_ip``, ``kv_port``, then the role's ``[pd]
        producer`` / ``consumer`` table (which may override any of them).

    Raises:
        PDConfigError: the two ports are equal.

    """
    if producer_kv_port == consumer_kv_port:
        raise PDConfigError(f"P/D: producer and consumer kv_port are both "
                            f"{producer_kv_port}; each server needs its own")
    out = {}
    for role, rank, port, over in (
            ("producer", 0, producer_kv_port, settings.producer),
            ("consumer", 1, consumer_kv_port, settings.consumer)):
        cfg = _merge(base, {"kv_role": f"kv_{role}", "kv_rank": rank,
                            "kv_parallel_size": 2, "kv_ip": host, "kv_port": port})
        out[role] = _merge(cfg, over)
    return out


def serve_arg(args: Sequence[str], name: str) -> str | None:
    """Value of ``--name V`` or ``--name=V`` in ``args`` (last wins), else None."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def check_pd_compatible(configs: Mapping[str, Mapping[str, Any]],
                        args: Mapping[str, Sequence[str]]) -> None:
    """Static start-up check: the two sides can exchange KV.

    ``args`` is ``{"producer": serve args, "consumer": serve args}``.

    Raises:
        PDConfigError: kv_role not producer/consumer, a different connector, or a
            differing :data:`MUST_MATCH_ARGS` value (e.g. ``--block-size`` 16 vs 32),
            named with both values.

    """
    p, c = configs["producer"], configs["consumer"]
    problems = []
    if p.get("kv_role") != "kv_producer" or c.get("kv_role") != "kv_consumer":
        problems.append(f"kv_role is {p.get('kv_role')!r} / {c.get('kv_role')!r}, "
                        "expected 'kv_producer' / 'kv_consumer'")
    for key in ("kv_connector", "kv_connector_module_path"):
        if p.get(key) != c.get(key):
            problems.append(f"{key} differs: producer {p.get(key)!r}, consumer "
                            f"{c.get(key)!r}")
    for name, what in MUST_MATCH_ARGS.items():
        a, b = serve_arg(args["producer"], name), serve_arg(args["consumer"], name)
        if a != b:
            problems.append(f"{name} ({what}) differs: producer {a or 'default'}, "
                            f"consumer {b or 'default'}")
    if problems:
        raise PDConfigError(
            "check_pd_compatible: the P/D pair cannot share KV — "
            + "; ".join(problems) + ". Give both servers the same settings")


def check_block_sizes_match(producer: VllmClient, consumer: VllmClient) -> int:
    """Runtime check: both servers report the same KV block size; returns B in tokens.

    Reads the ``block_size`` label of ``vllm:cache_config_info``.

    Raises:
        PDConfigError: they differ (a transfer would put tokens into the wrong slots).

    """
    bp, bc = producer.block_size(), consumer.block_size()
    if bp != bc:
        raise PDConfigError(
            f"check_block_sizes_match: the producer serves KV blocks of {bp} tokens, "
            f"the consumer of {bc}: the consumer would place the producer's KV into "
            "the wrong slots. Start both with the same --block-size")
    return bp


# ------------------------------------------------------------------- request ids
def pd_request_id(producer_zmq: str, consumer_zmq: str, uid: str | None = None
                  ) -> str:
    """The request id P2pNcclConnector routes by (see the module docstring).

    Returns ``___prefill_addr_<producer>___decode_addr_<consumer>_<uid>``; addresses are
    ``ip:kv_port``, ``uid`` defaults to a random hex UUID (no ``:``).
    """
    return (f"___prefill_addr_{producer_zmq}___decode_addr_{consumer_zmq}_"
            f"{uid or uuid.uuid4().hex}")


def parse_pd_request_id(request_id: str, is_prefill: bool) -> tuple[str, int]:
    """The peer address in ``request_id``, as P2pNcclConnector.parse_request_id does.

    vLLM may prefix ``cmpl-`` and suffix ``-<n>``; ``is_prefill`` True (producer side)
    returns the consumer's address.

    Raises:
        PDConfigError: the id carries no such address.

    """
    rx = (r"___decode_addr_(.*):(\d+)" if is_prefill
          else r"___prefill_addr_(.*):(\d+)___")
    m = re.search(rx, request_id)
    if not m:
        raise PDConfigError(f"request id {request_id!r} has no "
                            f"{'decode' if is_prefill else 'prefill'} address")
    return m.group(1), int(m.group(2))


# ------------------------------------------------------------------------ router
@dataclass
class PDResult:
    """One routed request.

    Attributes:
        request_id: the id sent to both servers (``X-Request-Id``).
        ttft_s: seconds from sending the prefill to the consumer's first token.
        prefill_s: seconds the producer took.
        kv_transfer_params: what the producer returned (``kv_transfer_params`` routing),
            else None.

    """

    request_id: str
    prefill: Completion
    completion: Completion
    ttft_s: float
    prefill_s: float
    kv_transfer_params: dict[str, Any] | None = None


class PDRouter:
    """A tiny in-process P/D router: prefill on the producer, decode on the consumer.

    ``routing`` is one of :data:`ROUTINGS`; the ``*_zmq`` addresses (``ip:kv_port``)
    serve ``request_id`` routing; ``timeout_s`` is per request, in seconds.
    """

    def __init__(self, producer_url: str, consumer_url: str, routing: str, *,
                 producer_zmq: str = "", consumer_zmq: str = "",
                 prefill_max_tokens: int = PREFILL_MAX_TOKENS,
                 timeout_s: float = 300.0) -> None:
        if routing not in ROUTINGS:
            raise PDConfigError(f"routing {routing!r} is not one of {ROUTINGS}")
        if routing == "request_id" and not (producer_zmq and consumer_zmq):
            raise PDConfigError("request_id routing needs both ZMQ addresses")
        self.routing = routing
        self.producer = VllmClient(producer_url, timeout_s=timeout_s)
        self.consumer = VllmClient(consumer_url, timeout_s=timeout_s)
        self.producer_zmq, self.consumer_zmq = producer_zmq, consumer_zmq
        self.prefill_max_tokens = prefill_max_tokens

    def request_id(self) -> str:
        """A fresh request id for the routing convention."""
        if self.routing == "request_id":
            return pd_request_id(self.producer_zmq, self.consumer_zmq)
        return f"tvc-pd-{uuid.uuid4().hex}"

    def complete(self, prompt: Sequence[int], max_tokens: int = 16,
                 logprobs: int = 5) -> PDResult:
        """Route one greedy request (see the class doc).

        Raises:
            requests.HTTPError: a server answered with an error status (says which
                side).
            ServerError: the consumer's stream carried no token.

        """
        rid = self.request_id()
        pre_extra: dict[str, Any] = {}
        if self.routing == "kv_transfer_params":
            pre_extra["kv_transfer_params"] = {
                "do_remote_decode": True, "do_remote_prefill": False,
                "remote_engine_id": None, "remote_block_ids": None,
                "remote_host": None, "remote_port": None}
        t0 = time.perf_counter()
        prefill, params = self._post(self.producer, "producer (prefill)", rid, prompt,
                                     self.prefill_max_tokens, logprobs, pre_extra)
        prefill_s = time.perf_counter() - t0
        dec_extra: dict[str, Any] = {}
        if self.routing == "kv_transfer_params":
            if not params:
                raise PDConfigError(
                    "kv_transfer_params routing: the producer's response carries no "
                    "kv_transfer_params, so the consumer cannot find the KV; the "
                    "producer's connector does not support remote decode")
            dec_extra["kv_transfer_params"] = params
        completion = self._stream(rid, prompt, max_tokens, logprobs, dec_extra)
        ttft = prefill_s + (completion.ttft_s or 0.0)
        return PDResult(rid, prefill, completion, ttft, prefill_s, params)

    def _post(self, client: VllmClient, side: str, rid: str, prompt: Sequence[int],
              max_tokens: int, logprobs: int, extra: Mapping[str, Any]
              ) -> tuple[Completion, dict[str, Any] | None]:
        from tvc.procs.client import _Accumulator, completion_body

        body = completion_body(client.model, list(prompt), max_tokens, logprobs,
                               **dict(extra))
        r = client.session.post(f"{client.base_url}/v1/completions", json=body,
                                headers={"X-Request-Id": rid},
                                timeout=client.timeout_s)
        if r.status_code >= 400:
            raise requests.HTTPError(f"P/D {side} {client.base_url} answered "
                                     f"{r.status_code}: {r.text[:1000]}", response=r)
        data = r.json()
        acc = _Accumulator()
        acc.add(data)
        return acc.result(ttft_s=None, latency_s=0.0), data.get("kv_transfer_params")

    def _stream(self, rid: str, prompt: Sequence[int], max_tokens: int,
                logprobs: int, extra: Mapping[str, Any]) -> Completion:
        c = self.consumer
        orig = c.session.headers.get("X-Request-Id")
        c.session.headers["X-Request-Id"] = rid
        try:
            return c.complete_streaming(list(prompt), max_tokens=max_tokens,
                                        logprobs=logprobs, **extra)
        except requests.HTTPError as exc:
            raise requests.HTTPError(f"P/D consumer (decode) {c.base_url}: {exc}"
                                     ) from None
        finally:
            if orig is None:
                c.session.headers.pop("X-Request-Id", None)
            else:
                c.session.headers["X-Request-Id"] = orig


# ------------------------------------------------------------------------- owner
class PDPair:
    """Owns the producer and the consumer server of one P/D pair.

    The producer runs with ``CUDA_VISIBLE_DEVICES`` = ``producer_gpu``, the consumer
    with ``consumer_gpu``, both with ``VLLM_HOST_IP`` = :data:`HOST` (P2pNcclConnector
    binds ``get_ip():kv_port``). :meth:`start` runs :func:`check_pd_compatible` first
    and :func:`check_block_sizes_match` once both answer. Logs go to ``log_dir`` as
    ``pd-producer-*.log`` / ``pd-consumer-*.log``; ``startup_timeout_s`` is per server.
    ``block_size`` is 0 until started.
    """

    def __init__(self, model: str | Path, base_config: Mapping[str, Any],
                 settings: PDSettings, serve_args: Sequence[str], log_dir: Path, *,
                 producer_args: Sequence[str] = (), consumer_args: Sequence[str] = (),
                 launcher: Sequence[str] = VLLM_LAUNCHER,
                 env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = 600.0) -> None:
        self.settings = settings
        self.model = str(model)
        self.kv_ports = (free_port(HOST), free_port(HOST))
        self.configs = build_role_configs(base_config, settings,
                                          producer_kv_port=self.kv_ports[0],
                                          consumer_kv_port=self.kv_ports[1])
        self.args = {"producer": [*serve_args, *producer_args],
                     "consumer": [*serve_args, *consumer_args]}
        stamp = time.strftime("%H%M%S")
        self.servers: dict[str, VllmServer] = {}
        for role, gpu in (("producer", settings.producer_gpu),
                          ("consumer", settings.consumer_gpu)):
            self.servers[role] = VllmServer(
                self.model, kv_transfer_config=self.configs[role],
                serve_args=self.args[role],
                log_path=Path(log_dir) / f"pd-{role}-{stamp}.log",
                env={**dict(env or {}), "CUDA_VISIBLE_DEVICES": str(gpu),
                     "VLLM_HOST_IP": HOST},
                launcher=launcher, startup_timeout_s=startup_timeout_s,
                # one server on each of two GPUs, both up at once: neither may
                # park the other (tvc.procs.vllm_server's one-server-per-GPU slot)
                exclusive_gpu=False)
        self.block_size = 0

    @property
    def producer(self) -> VllmServer:
        """The producer's server."""
        return self.servers["producer"]

    @property
    def consumer(self) -> VllmServer:
        """The consumer's server."""
        return self.servers["consumer"]

    def zmq_address(self, role: str) -> str:
        """``ip:kv_port`` of a role's transfer listener."""
        cfg = self.configs[role]
        return f"{cfg.get('kv_ip', HOST)}:{cfg['kv_port']}"

    def start(self) -> None:
        """Check, start the producer, then the consumer, then check block sizes.

        Raises:
            PDConfigError: :func:`check_pd_compatible` (nothing started) or
                :func:`check_block_sizes_match` (both stopped again).
            ServerError: a server did not start (the other is stopped).

        """
        check_pd_compatible(self.configs, self.args)
        try:
            self.producer.start()
            self.consumer.start()
            self.block_size = check_block_sizes_match(self.producer.client(),
                                                      self.consumer.client())
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop both servers (idempotent)."""
        for srv in self.servers.values():
            srv.stop()

    def leftovers(self) -> list[Any]:
        """Processes of either server alive after :meth:`stop`."""
        return [p for s in self.servers.values() for p in s.leftovers()]

    def router(self, timeout_s: float = 300.0) -> PDRouter:
        """A :class:`PDRouter` for the running pair."""
        return PDRouter(self.producer.url, self.consumer.url, self.settings.routing,
                        producer_zmq=self.zmq_address("producer"),
                        consumer_zmq=self.zmq_address("consumer"),
                        prefill_max_tokens=self.settings.prefill_max_tokens,
                        timeout_s=timeout_s)

    def __enter__(self) -> PDPair:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def counters(client: VllmClient) -> dict[str, float]:
    """The consumer-side counters a P/D check reads (external hits, successes)."""
    snap = client.metrics()
    return {"external_hits": snap.value(EXTERNAL_HITS_METRIC),
            "requests_ok": snap.value(REQUEST_SUCCESS_METRIC)}


def check_same_as_baseline(baseline: Completion, got: Completion, what: str,
                           atol: float) -> None:
    """``got`` equals the single-engine ``baseline``: greedy tokens, then logprobs.

    Tokens identical up to the first baseline tie (within
    :data:`tvc.e2e.two_pass.TIE_NATS`); up to there shared top-k logprobs within
    ``atol`` nats.

    Raises:
        AssertionError: names ``what``, the position and both values.

    """
    from tvc.e2e import two_pass

    def tie(i: int) -> bool:
        top = baseline.top_logprobs[i] if i < len(baseline.top_logprobs) else {}
        best = max(top.values(), default=None)
        return best is not None and all(
            t in top and best - top[t] <= two_pass.TIE_NATS
            for t in (baseline.token_ids[i], got.token_ids[i]))

    a, b = baseline.token_ids, got.token_ids
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    assert len(a) == len(b), (f"{what}: {len(b)} tokens, the baseline {len(a)}")
    if first is not None:
        assert tie(first), (
            f"{what}: output token ids differ from the single-engine baseline at "
            f"position {first}: baseline {a}, got {b} — the KV it used is not the "
            "KV the baseline computed")
        n = first + 1
    for i in range(min(n, len(baseline.top_logprobs), len(got.top_logprobs))):
        da, db = baseline.top_logprobs[i], got.top_logprobs[i]
        for t in da.keys() & db.keys():
            assert abs(da[t] - db[t]) <= atol, (
                f"{what}: logprob of token {t} at position {i}: baseline "
                f"{da[t]:.4f}, got {db[t]:.4f}, |diff| {abs(da[t] - db[t]):.4f} > "
                f"{atol} nats — the KV it used differs from the baseline's")



def connector_missing_reason(profile: Profile) -> str:
    """Why the installed vLLM cannot build the profile's connector ('' if it can).

    ``module_path`` must be importable, else the name registered in
    ``KVConnectorFactory`` (P2pNcclConnector is not in 0.26.0 or 0.28.0:
    vllm-project/vllm#44854).
    """
    import importlib.util

    c = profile["connector"]
    if c["module_path"]:
        try:
            found = importlib.util.find_spec(c["module_path"]) is not None
        except ModuleNotFoundError:
            found = False
        return "" if found else (
            f"the connector module {c['module_path']!r} is not importable")
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if registry is None or c["name"] in registry:
        return ""
    return (f"vLLM {vllm.__version__} does not register {c['name']!r} (it has: "
            f"{', '.join(sorted(registry))}); run this profile with a vLLM that has "
            "it, or set [connector] module_path to an out-of-tree copy")


@dataclass
class PDRun:
    """Prompts routed through a pair, with the counters they moved.

    Attributes:
        consumer_hits: rise of the consumer's external prefix cache hits (tokens).
        producer_hits: rise of the producer's (tokens; 0 for fresh prompts).

    """

    results: list[PDResult]
    consumer_hits: int
    producer_hits: int
    block_size: int
    routing: str


def route_prompts(pair: PDPair, prompts: Sequence[Sequence[int]], *,
                  max_tokens: int = 16, logprobs: int = 5) -> PDRun:
    """Route each prompt through ``pair`` and measure both servers' hit counters.

    Counters are read once vLLM counted every request finished
    (``vllm:request_success``).
    """
    router = pair.router()
    p0, c0 = counters(router.producer), counters(router.consumer)
    results = [router.complete(p, max_tokens=max_tokens, logprobs=logprobs)
               for p in prompts]
    c1 = router.consumer.wait_for_metric(REQUEST_SUCCESS_METRIC,
                                         c0["requests_ok"] + len(prompts))
    p1 = counters(router.producer)
    return PDRun(results, int(c1.value(EXTERNAL_HITS_METRIC) - c0["external_hits"]),
                 int(p1["external_hits"] - p0["external_hits"]), pair.block_size,
                 pair.settings.routing)


def check_kv_came_from_producer(run: PDRun, expected: int) -> None:
    """The producer computed; the consumer got ``expected`` tokens from it.

    ``expected`` is the hit rule's tokens summed over the prompts.

    Raises:
        AssertionError: the producer had external hits (a stale store), the rule expects
            nothing, or the consumer's external hits differ from ``expected`` (0: the KV
            never arrived).

    """
    n = len(run.results)
    assert run.producer_hits == 0, (
        f"check_kv_came_from_producer: the producer got {run.producer_hits} external "
        "hit tokens for fresh random prompts — its store answered prompts it was "
        "never given")
    assert expected > 0, (
        "check_kv_came_from_producer: the profile's hit rule expects 0 transferred "
        "tokens for these prompts, so the pair would prove nothing; use longer "
        "prompts ([e2e] prompt_tokens)")
    if run.consumer_hits == expected:
        return
    why = ("the consumer computed the prompts itself: the KV never arrived (check "
           f"the routing {run.routing!r} and both servers' logs)"
           if run.consumer_hits == 0 else
           "the consumer took a different number of tokens from the producer than "
           "the hit rule says")
    raise AssertionError(
        f"check_kv_came_from_producer: consumer external prefix cache hits for {n} "
        f"routed prompt(s) at block size {run.block_size}: expected {expected} "
        f"tokens, saw {run.consumer_hits} — {why}")
