"""The trace tier's machinery: settings, sizes, the two servers, the replay campaign.

Settings: command line, then ``[trace]``, then the size's defaults (:data:`SIZES`):
``smoke`` (profile model, 64 tokens per hash id, outputs <= 32) or ``large`` (a
Llama-3-8B-shaped ``--load-format dummy`` config, 512 tokens per hash id, outputs <= 64,
``--max-model-len 8448 --gpu-memory-utilization 0.6``). Pressure sets
``--num-gpu-blocks-override`` (``[trace] num_gpu_blocks_override``, else
:data:`tvc.trace.replay.PRESSURE_FRACTION` of the working set), ``--block-size 16`` and
a lowered ``--max-model-len``. :class:`TraceCampaign` (fixture ``trace_campaign``) runs
each mode per variant (``connector``, ``baseline``), one server at a time, populating
and dropping the local prefix cache before ``interleave``/``stream``; runs go to ``<run
folder>/trace/<variant>-<mode>.json``. Options: docs/tiers.md, "trace (GPU)".
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

    Zero means none/all/report-only for ``max_duration_s`` (s), ``max_requests`` and
    ``min_ttft_gain`` (interleave p50); ``num_gpu_blocks_override`` 0 is computed under
    pressure, else vLLM's sizing. ``sources`` maps key -> ``cli``, ``profile`` or
    ``size``.
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
    """Merge command line (``options``, None = not given), profile ``[trace]`` and size.

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

    Tokenizer files and vocab size come from ``tokenizer_from``; ``shape`` is the HF
    config without ``vocab_size``. Returns ``root/dummy-<layers>l-<hidden>h-v<vocab>``.
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

    ``make_server`` is ``(model_dir, stem, **overrides) -> VllmServer`` (not started),
    as :func:`tvc.fixtures.vllm.server_from_profile`; the campaign passes the variant's
    ``kv_transfer_config``, serve args and ``whole_gpu``. ``server_factory`` is
    ``(variant) -> VllmServer`` instead (self-test fakes). Results go to ``out_dir``.
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

        A pooled server (:mod:`tvc.procs.pool`) not needing a whole GPU keeps the other
        variant's up beside it; otherwise the other is stopped first.
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
        """Figures of one mode on one variant (run on first call, then cached).

        Returns :meth:`tvc.trace.replay.RunResult.figures` plus ``trace_settings``, also
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

        Written to ``<out_dir>/<variant>-<mode>-r<N>.json`` and kept in :attr:`repeats`.
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
