"""The trace tier's machinery: settings, sizes, the two servers, the replay campaign.

Settings come from, first match wins: the command line, the profile's ``[trace]``
section, the size's defaults (:data:`SIZES`).

Options:

``--tvc-trace-file PATH``
    a Mooncake-format JSONL trace (default ``[trace] path``, else
    ``tvc/data/traces/smoke.jsonl``).
``--tvc-trace-size smoke|large``
    ``smoke``: the profile's model (the tiny Llama by default), 64 tokens per hash id
    (the shipped trace's prompts become 513-960 tokens), outputs capped at 32 tokens.
    ``large``: a Llama-3-8B-shaped config with ``--load-format dummy`` (random
    weights, no download), 512 tokens per hash id (4-8k-token prompts), outputs
    capped at 64, ``--max-model-len 8448 --gpu-memory-utilization 0.6``.
``--tvc-trace-time-scale X``, ``--tvc-trace-max-duration S``,
``--tvc-trace-concurrency N``, ``--tvc-trace-max-requests N``
    override the ``[trace]`` keys of the same names.
``--tvc-trace-pressure``
    put the GPU KV cache under pressure (``[trace] pressure = true``): both servers
    get ``--num-gpu-blocks-override N`` with N = ``[trace] num_gpu_blocks_override``
    or, when that is 0, :data:`tvc.trace.replay.PRESSURE_FRACTION` of the trace's
    working
    set in KV blocks (never below one ``--max-model-len`` request), ``--block-size
    16`` unless the serve args set one, and ``--max-model-len`` lowered to the
    longest request; the baseline then recomputes reuse the connector can load.
    A ``num_gpu_blocks_override`` > 0 applies with or without pressure.

The campaign (:class:`TraceCampaign`, fixture ``trace_campaign``) runs each mode once
per variant: ``connector`` (the profile's ``--kv-transfer-config``) and ``baseline``
(the same server without it). One server runs at a time. Before ``interleave`` and
``stream`` it makes sure ``populate`` ran on that variant and drops the server's local
prefix cache, so reuse has to come from the connector's store (the baseline
recomputes). Each run is written to ``<run folder>/trace/<variant>-<mode>.json``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tvc.config.profile import REPO_ROOT, Profile
from tvc.trace import replay as tr
from tvc.trace.options import SIZE_NAMES, add_options, positive  # noqa: F401

VARIANTS = ("connector", "baseline")


@dataclass(frozen=True)
class SizeSpec:
    """Defaults of one trace size.

    Attributes:
        tokens_per_hash_id: tokens per trace hash id.
        max_output_tokens: cap on ``output_length``.
        serve_args: appended after the profile's ``vllm.serve_args`` (later wins).
        dummy_config: when set, the served model is this HF config with the served
            model's tokenizer, loaded with ``--load-format dummy``.

    """

    tokens_per_hash_id: int
    max_output_tokens: int
    serve_args: tuple[str, ...] = ()
    dummy_config: dict[str, Any] | None = None


# Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json); the vocabulary is the
# served model's tokenizer's (the tiny Llama's 512 ids), so ~7.0e9 parameters.
LLAMA3_8B_SHAPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8448,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# Sizes whose servers run alone on their GPU in the server pool (tvc.procs.pool): the
# large trace's 8B model and GPU-cache pressure must not share the GPU.
WHOLE_GPU_SIZES = ("large",)

SIZES: dict[str, SizeSpec] = {
    "smoke": SizeSpec(tokens_per_hash_id=64, max_output_tokens=32),
    "large": SizeSpec(
        tokens_per_hash_id=tr.MOONCAKE_BLOCK_TOKENS, max_output_tokens=64,
        serve_args=("--load-format", "dummy", "--max-model-len", "8448",
                    "--gpu-memory-utilization", "0.6"),
        dummy_config=LLAMA3_8B_SHAPE),
}


@dataclass
class TraceSettings:
    """The trace tier's settings for one run (see the module docstring).

    Attributes:
        path: the trace file.
        size: a key of :data:`SIZES`.
        tokens_per_hash_id: tokens per hash id.
        time_scale: stream mode time factor.
        max_duration_s: stream mode bound in seconds (0 = none).
        concurrency: requests in flight at most.
        max_requests: first N records (0 = all).
        max_output_tokens: cap on output tokens.
        min_ttft_gain: required interleave p50 TTFT gain (0 = report only).
        request_timeout_s: per-request timeout in seconds.
        pressure: size the GPU KV cache below the trace's working set.
        num_gpu_blocks_override: GPU KV blocks for both servers (0 = computed
            under pressure, vLLM's own sizing otherwise).
        sources: key -> where its value came from (``cli``, ``profile``, ``size``).

    """

    path: Path
    size: str
    tokens_per_hash_id: int
    time_scale: float
    max_duration_s: float
    concurrency: int
    max_requests: int
    max_output_tokens: int
    min_ttft_gain: float
    request_timeout_s: float
    pressure: bool = False
    num_gpu_blocks_override: int = 0
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> SizeSpec:
        """The size's :class:`SizeSpec`."""
        return SIZES[self.size]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready settings."""
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def resolve_settings(profile: Profile, options: dict[str, Any] | None = None
                     ) -> TraceSettings:
    """Merge command line, profile ``[trace]`` and size defaults.

    Args:
        profile: the run's profile.
        options: command-line values by ``[trace]`` key (None = not given).

    Returns:
        the :class:`TraceSettings`.

    Raises:
        tr.TraceError: an unknown size or a trace path that is not a file.

    """
    options = {k: v for k, v in (options or {}).items() if v is not None}
    prof = dict(profile["trace"]) if "trace" in profile.data else {}
    sources: dict[str, str] = {}

    def pick(key: str, default: Any, zero_means_default: bool = False) -> Any:
        if key in options:
            sources[key] = "cli"
            return options[key]
        v = prof.get(key)
        if v not in (None, "") and not (zero_means_default and v == 0):
            sources[key] = "profile"
            return v
        sources[key] = "default"
        return default

    size = pick("size", "smoke")
    if size not in SIZES:
        raise tr.TraceError(f"trace size {size!r} is not known (known: "
                            f"{', '.join(SIZES)}); set [trace] size or "
                            "--tvc-trace-size")
    spec = SIZES[size]
    raw_path = pick("path", str(tr.SHIPPED_TRACE))
    path = Path(raw_path).expanduser()
    if not path.is_absolute():
        path = (REPO_ROOT / path) if (REPO_ROOT / path).is_file() else path.resolve()
    if not path.is_file():
        raise tr.TraceError(f"trace file {path} does not exist; give an existing "
                            "Mooncake JSONL file with --tvc-trace-file or "
                            "[trace] path")
    return TraceSettings(
        path=path, size=size,
        tokens_per_hash_id=pick("tokens_per_hash_id", spec.tokens_per_hash_id, True),
        time_scale=float(pick("time_scale", 1.0)),
        max_duration_s=float(pick("max_duration_s", 60.0)),
        concurrency=int(pick("concurrency", 4, True)),
        max_requests=int(pick("max_requests", 0)),
        max_output_tokens=int(pick("max_output_tokens", spec.max_output_tokens, True)),
        min_ttft_gain=float(pick("min_ttft_gain", 0.0)),
        request_timeout_s=float(pick("request_timeout_s", 300.0, True)),
        pressure=bool(pick("pressure", False)),
        num_gpu_blocks_override=_non_negative(
            "num_gpu_blocks_override", pick("num_gpu_blocks_override", 0)),
        sources=sources)


def _non_negative(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise tr.TraceError(f"[trace] {key}: expected a non-negative integer, got "
                            f"{value!r}")
    return value


def build_dummy_model(root: Path, tokenizer_from: Path,
                      shape: dict[str, Any] = LLAMA3_8B_SHAPE) -> Path:
    """A model folder with a large config and no weights (``--load-format dummy``).

    Args:
        root: cache folder (``<profile scratch>/models``).
        tokenizer_from: a model folder whose tokenizer files (and vocab size) to use.
        shape: the HF config without ``vocab_size``.

    Returns:
        ``root/dummy-<layers>l-<hidden>h-v<vocab>``: config.json,
        generation_config.json (when the source has one) and the tokenizer files.

    """
    src_cfg = json.loads((tokenizer_from / "config.json").read_text())
    vocab = int(src_cfg["vocab_size"])
    cfg = {**shape, "vocab_size": vocab}
    for key in ("bos_token_id", "eos_token_id"):
        if key in src_cfg:
            cfg[key] = src_cfg[key]
    dest = root / (f"dummy-{cfg['num_hidden_layers']}l-{cfg['hidden_size']}h-"
                   f"v{vocab}-ctx{cfg['max_position_embeddings']}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "tokenizer.model"):
        if (tokenizer_from / name).is_file():
            shutil.copyfile(tokenizer_from / name, dest / name)
    tc = dest / "tokenizer_config.json"
    if tc.is_file():
        data = json.loads(tc.read_text())
        data["model_max_length"] = cfg["max_position_embeddings"]
        tc.write_text(json.dumps(data, indent=2) + "\n")
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest


class TraceCampaign:
    """Runs replay modes against the connector and baseline servers, one at a time.

    Args:
        profile: the run's profile.
        settings: the trace settings.
        model_dir: the served model folder.
        out_dir: where ``<variant>-<mode>.json`` files go.
        make_server: ``(model_dir, stem, **overrides) -> VllmServer`` (not
            started), as :func:`tvc.fixtures.vllm.server_from_profile` with the
            run's config bound; the campaign passes the variant's
            ``kv_transfer_config``, the size's serve args and ``whole_gpu``.
        server_factory: ``(variant) -> VllmServer`` instead (fakes in the
            self-tests).

    """

    def __init__(self, profile: Profile, settings: TraceSettings, model_dir: Path,
                 out_dir: Path, make_server: Any = None,
                 server_factory: Any = None) -> None:
        self.make_server = make_server
        self.profile = profile
        self.settings = settings
        self.model_dir = model_dir
        self.out_dir = out_dir
        self.records = tr.load_trace(settings.path)
        self.results: dict[tuple[str, str], dict[str, Any]] = {}
        self.repeats: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._servers: dict[str, Any] = {}  # variant -> its running server
        self._starts: dict[str, int] = {}  # variant -> starts so far
        self._populated: dict[str, int] = {}  # variant -> start it was populated in
        self._factory = server_factory or self._default_factory
        lo, hi = _token_range(model_dir)
        self.synth = tr.PromptSynth(settings.tokens_per_hash_id, lo, hi)
        self.max_prompt_tokens = _max_prompt_tokens(profile, settings)
        self.pressure: dict[str, Any] | None = None
        self.extra_serve_args: list[str] = []
        self._plan_pressure()

    def base_serve_args(self) -> list[str]:
        """The profile's serve args, then the size's (later wins in vLLM's parser)."""
        return [*self.profile["vllm"]["serve_args"], *self.settings.spec.serve_args]

    def serve_args(self) -> list[str]:
        """Both variants' serve args: base args, then the pressure sizing."""
        return [*self.base_serve_args(), *self.extra_serve_args]

    def _plan_pressure(self) -> None:
        """Work out ``--num-gpu-blocks-override`` (see the module docstring)."""
        s = self.settings
        if not s.pressure and not s.num_gpu_blocks_override:
            return
        args = self.base_serve_args()
        block = _last_int_arg(args, "--block-size")
        extra: list[str] = []
        if block is None:
            block = tr.DEFAULT_BLOCK_SIZE
            extra += ["--block-size", str(block)]
        distinct = [p.prompt for p in tr.plan(
            self.records, "populate", self.synth, max_requests=s.max_requests,
            max_prompt_tokens=self.max_prompt_tokens)]
        longest = max((len(p.prompt) + p.max_tokens for p in tr.plan(
            self.records, "interleave", self.synth,
            max_output_tokens=s.max_output_tokens, max_requests=s.max_requests,
            max_prompt_tokens=self.max_prompt_tokens)), default=1)
        limit = _last_int_arg(args, "--max-model-len")
        if s.pressure:  # a lower limit lowers vLLM's floor on the cache size
            need = -(-longest // block) * block
            if limit is None or need < limit:
                limit = need
                extra += ["--max-model-len", str(limit)]
        plan = tr.pressure_plan(distinct, block, limit or longest,
                                override=s.num_gpu_blocks_override)
        extra += ["--num-gpu-blocks-override", str(plan["num_gpu_blocks"])]
        self.pressure = {**plan, "requested": s.pressure, "serve_args": extra}
        self.extra_serve_args = extra

    def _default_factory(self, variant: str) -> Any:
        if self.make_server is None:
            raise tr.TraceError("TraceCampaign: neither make_server nor "
                                "server_factory was given")
        args = self.serve_args()
        kv = self.profile.kv_transfer_config() if variant == "connector" else None
        return self.make_server(self.model_dir, f"trace-{variant}",
                                kv_transfer_config=kv, serve_args=args,
                                profile=self.profile,
                                whole_gpu=self.settings.size in WHOLE_GPU_SIZES)

    def server_spec(self, variant: str) -> Any:
        """The (not started) server of ``variant``, as :meth:`server` builds it."""
        return self._factory(variant)

    def server(self, variant: str) -> Any:
        """The running server of ``variant``.

        A server of the run's server pool (:mod:`tvc.procs.pool`) that does not need a
        whole GPU keeps the other variant's server up beside it (idle while this
        one replays), so repeats need no restart; otherwise the other one is
        stopped first (one trace server on the GPU).
        """
        srv = self._servers.get(variant)
        if srv is not None and srv.is_alive():
            return srv
        srv = self._factory(variant)
        beside = (getattr(srv, "pool", None) is not None
                  and not getattr(srv, "whole_gpu", False))
        if not beside:
            self.close()
        try:
            srv.start()
        except Exception as exc:
            if type(exc).__name__ == "ServerError":  # tvc.procs.vllm_server
                pytest.fail(f"trace tier, {variant} server: {exc}", pytrace=False)
            raise
        self._servers[variant] = srv
        self._starts[variant] = self._starts.get(variant, 0) + 1
        return srv

    def close(self) -> None:
        """Stop the running servers, if any."""
        for srv in self._servers.values():
            srv.stop()
        self._servers.clear()

    def model_name(self, srv: Any) -> str:
        """The model name the server serves (``/v1/models``)."""
        return srv.client().model

    def run(self, variant: str, mode: str) -> dict[str, Any]:
        """Figures of one mode on one variant (runs it on first call; cached).

        Args:
            variant: ``connector`` or ``baseline``.
            mode: a mode of :data:`tvc.trace.replay.MODES`.

        Returns:
            :meth:`tvc.trace.replay.RunResult.figures` plus ``trace_settings``; also
            written to ``<out_dir>/<variant>-<mode>.json``.

        """
        key = (variant, mode)
        if key in self.results:
            return self.results[key]
        fig = self._replay(variant, mode)
        tr.write_json(self.out_dir / f"{variant}-{mode}.json", fig)
        self.results[key] = fig
        return fig

    def repeat(self, variant: str, mode: str) -> dict[str, Any]:
        """Replay ``mode`` on ``variant`` once more (not cached), for a stable figure.

        Returns:
            the repeat's figures, also written to
            ``<out_dir>/<variant>-<mode>-r<N>.json`` and kept in :attr:`repeats`.

        """
        self.run(variant, mode)
        fig = self._replay(variant, mode)
        done = self.repeats.setdefault((variant, mode), [])
        done.append(fig)
        tr.write_json(self.out_dir / f"{variant}-{mode}-r{len(done) + 1}.json", fig)
        return fig

    def _replay(self, variant: str, mode: str) -> dict[str, Any]:
        """One replay of ``mode`` on ``variant`` (populating its store first)."""
        srv = self.server(variant)
        if mode != "populate" and self._populated.get(variant) != self._starts[
                variant]:  # a new server process: its store must be filled again
            pop = self._replay(variant, "populate")
            if (variant, "populate") not in self.results:
                tr.write_json(self.out_dir / f"{variant}-populate.json", pop)
                self.results[variant, "populate"] = pop
            srv = self.server(variant)
        if mode == "populate":
            self._populated[variant] = self._starts[variant]
        notes: list[str] = []
        if mode != "populate":
            try:
                srv.client().reset_prefix_cache()
                notes.append("local prefix cache reset before the run")
            except Exception as exc:  # noqa: BLE001 - recorded, checked by the test
                notes.append(f"local prefix cache NOT reset: {exc}")
        s = self.settings
        planned = tr.plan(self.records, mode, self.synth,
                          max_output_tokens=s.max_output_tokens,
                          time_scale=s.time_scale, max_duration_s=s.max_duration_s,
                          max_requests=s.max_requests,
                          max_prompt_tokens=self.max_prompt_tokens)
        cfg = {"profile": self.profile.name, "model": str(self.model_dir),
               "max_prompt_tokens": self.max_prompt_tokens,
               "token_range": [self.synth.token_low, self.synth.token_high],
               "server_args": list(getattr(srv, "argv", [])),
               "gpu_cache_pressure": self.pressure,
               **s.as_dict()}
        if self.pressure is not None and mode != "populate":
            cfg["ideal_local_hit_tokens"] = tr.ideal_local_hits(
                [p.prompt for p in planned], self.pressure["block_size"])
        res = tr.replay(srv.url, self.model_name(srv), planned, mode=mode,
                        variant=variant, concurrency=s.concurrency,
                        timeout_s=s.request_timeout_s, config=cfg)
        res.notes += notes
        return res.figures()


def _token_range(model_dir: Path) -> tuple[int, int]:
    from tvc.env.model import prompt_token_range

    return prompt_token_range(model_dir)


def _last_int_arg(args: list[str], flag: str) -> int | None:
    """The value of the last ``flag N`` / ``flag=N`` in ``args`` (None if absent)."""
    value: int | None = None
    for i, a in enumerate(args):
        raw = (args[i + 1] if a == flag and i + 1 < len(args)
               else a.split("=", 1)[1] if a.startswith(flag + "=") else None)
        if raw is not None:
            try:
                value = int(raw)
            except ValueError:
                raise tr.TraceError(f"serve args: {flag} {raw!r} is not an "
                                    "integer") from None
    return value


def _max_prompt_tokens(profile: Profile, settings: TraceSettings) -> int:
    """``--max-model-len`` (last one in the args) minus the output cap, or 0."""
    args = [*profile["vllm"]["serve_args"], *settings.spec.serve_args]
    limit = _last_int_arg(args, "--max-model-len") or 0
    return max(1, limit - settings.max_output_tokens) if limit else 0
