"""The profile schema: one pydantic model per TOML section, the source of truth.

Every key a profile may set is a field here, with its type, default, description
and bounds; anything else is refused (``extra="forbid"``), and types are strict (an
integer is accepted for a number, nothing else is converted). Validators for values
and cross-field rules run only on the final, interpolated profile (validation
context ``{"final": True}``); each file of an ``extends`` chain is first checked for
keys and types alone (:func:`tvc.config.profile.load`).

``python -m tvc.config.schema`` prints the JSON Schema for editors
(``tvc/data/profile.schema.json``); ``--markdown`` prints the key table of
``docs/profiles.md``; ``--write`` rewrites both.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from tvc.config import checks
from tvc.config.checks import MAX_CONTEXT_TOKENS, Refusal, shorten
from tvc.config.hit_rule import rule_variables

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
# vLLM's VLLM_LOGGING_LEVEL takes Python logging level names (vllm/envs.py)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# the torch device types the worker harness runs a connector's worker side on
# (tvc/contract/worker.py allocates KV caches there)
WORKER_DEVICES = ("cpu", "cuda")
# e2e.load_failure_fault: tvc.contract.faults modes that overwrite a loaded block (kept
# here, not imported, so loading a profile does not import vLLM).
LOAD_FAILURE_FAULTS = ("fail_load", "misreport_load", "corrupt_load")
# kv_transfer keys that would override name/module_path/kv_role/extra_config
KV_TRANSFER_RESERVED = {
    "kv_connector": "connector.name",
    "kv_connector_module_path": "connector.module_path",
    "kv_role": "connector.kv_role",
    "kv_connector_extra_config": "connector.extra_config",
}
MAX_NAME_CHARS = 64  # profile.name: it names the report and scratch folders
MAX_TP_SIZE = 64  # GPUs of one tensor-parallel group
MAX_TP_SIZES = 16  # entries of vllm.tensor_parallel_sizes
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_HOOK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:"
                   r"[A-Za-z_][A-Za-z0-9_]*")
_CONTEXT = "tokens of the longest context the tiers serve"
_DAY = "seconds in a day"
_IN_FLIGHT = "requests in flight from one client"


def _final(info: ValidationInfo) -> bool:
    """Whether this validation is of the final, interpolated profile."""
    return bool(info.context and info.context.get("final"))


def _tick(info: ValidationInfo, where: str) -> None:
    """Charge the load's CPU budget (``context["budget"]``) after costly checks."""
    budget = (info.context or {}).get("budget")
    if budget is not None:
        budget(where)


def _regex(pattern: str, info: ValidationInfo, where: str) -> str:
    """A regex key's check (:func:`tvc.config.checks.check_log_pattern`), final pass."""
    if _final(info) and pattern:
        checks.check_log_pattern(pattern)
        _tick(info, where)
    return pattern


def bounded(default: int | float, largest: int | float, why: str, description: str,
         least: int = 0) -> Any:
    """A number field bounded by ``least`` and ``largest`` (``why``: its unit)."""
    return Field(default, ge=least, le=largest, description=description,
                 json_schema_extra={"x-limit": why})


class Section(BaseModel):
    """A table of a profile: unknown keys refused, types strict, no NaN/inf."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ProfileSection(Section):
    """``[profile]``: the profile's name and what it extends."""

    name: str = Field(description="short name used in reports and the scratch "
                      "folder: 1 to 64 letters, digits, '.', '_' or '-'")
    description: str = Field("", description="one sentence for people")
    extends: str = Field("", description="built-in profile name or path (relative "
                         "to this file) to inherit every section from, overridden "
                         "per key")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str, info: ValidationInfo) -> str:
        if _final(info) and not (name and len(name) <= MAX_NAME_CHARS
                                 and NAME.fullmatch(name)):
            raise Refusal(f"{shorten(name)} must be 1 to {MAX_NAME_CHARS} letters, "
                          "digits, '.', '_' or '-' (it names the report and scratch "
                          "folders)")
        return name


class HitRule(Section):
    """One ``connector.hit_rules`` entry: the rule for a range of vLLM versions."""

    vllm: str = Field(description="PEP 440 specifier of the vLLM versions the rule "
                      "is for")
    rule: str = Field(description="the hit rule for those versions")
    source: str = Field("", description="where the rule comes from; default "
                        "connector.hit_rule_source")

    @field_validator("vllm")
    @classmethod
    def _vllm(cls, value: str, info: ValidationInfo) -> str:
        return checks.check_specifier(value) if _final(info) else value

    @field_validator("rule")
    @classmethod
    def _rule(cls, value: str, info: ValidationInfo) -> str:
        if _final(info) and not value:
            raise Refusal("empty")
        return value


class ConnectorSection(Section):
    """``[connector]``: the KV connector under test and what it promises."""

    name: str = Field(description="kv_connector: the connector class name")
    module_path: str = Field("", description="kv_connector_module_path; empty for "
                             "built-ins")
    kv_role: str = Field("kv_both", description="kv_role: kv_both, kv_producer or "
                         "kv_consumer", examples=list(KV_ROLES))
    extra_config: dict[str, Any] = Field({}, description="kv_connector_extra_config")
    required_extra_config_keys: list[str] = Field(
        [], description="keys the connector needs; dotted paths reach nested tables")
    kv_transfer: dict[str, Any] = Field(
        {}, description="further KVTransferConfig fields (kv_rank, kv_port, "
        "engine_id, ...) merged into kv_transfer_config()")
    hit_rule: str = Field("", description="matched tokens as an expression of len, "
                          "B and numeric top-level extra_config keys")
    hit_rules: list[HitRule] = Field(
        [], description="version-ranged hit rules: [{vllm = \"<PEP 440 "
        "specifier>\", rule = \"...\"}], first match wins over hit_rule")
    granularity: str = Field("B", description="tokens the connector stores per "
                             "unit, as an expression of the hit-rule variables")
    hit_log_level: str = Field("", description="log level the server needs for "
                               "hit_log_pattern to appear (e.g. DEBUG); empty = "
                               "default", examples=list(LOG_LEVELS))
    fault_injector: str = Field("", description="module:function fault injector; "
                                "empty = built-in by store kind")
    worker_report: str = Field("", description="\"\" = real worker, \"standin\" = "
                               "declared stand-in, \"real-only\" = nothing but the "
                               "real worker can report (where it cannot run, a "
                               "hardware skip), or module:function")
    hit_rule_source: str = Field("", description="where the hit rule comes from")
    hit_log_pattern: str = Field("", description="regex the server log shows on a "
                                 "hit; a group named tokens (else the first group) "
                                 "that captures a number is read as the hit's "
                                 "tokens")
    persistent_store: bool = Field(False, description="the store survives a server "
                                   "restart")
    size_keys: list[str] = Field([], description="required keys the connector must "
                                 "reject when mistyped or negative (contract tier)")
    worker_devices: list[str] = Field(["cuda"], description="devices the "
                                      "connector's worker side runs on: cuda, cpu "
                                      "(contract tier)")
    env: dict[str, Any] = Field(
        {}, description="environment the connector needs (strings, no VLLM_*): set "
        "in the pytest process for the in-process tiers (level1, contract) from "
        "the start of the run to its end, and for every vLLM server under [vllm] "
        "env, e.g. { LMCACHE_TRACK_USAGE = \"false\" }")
    lookups_need_worker: bool = Field(
        False, description="the scheduler side asks the worker side for every "
        "lookup (it would wait without one): the contract tier refuses a rig "
        "without the real worker before its first lookup")
    stores_decode: bool = Field(False, description="the connector stores the "
                                "output's blocks too, not only the prompt's (the "
                                "contract tier's write-volume bound counts them)")
    call_timeout_s: float = bounded(
        120.0, 3600.0, "seconds in an hour", "seconds one engine step of the "
        "contract tier (every connector call in it) may take before the watchdog "
        "stops it and fails the test naming the call", least=1)
    transfer_timeout_s: float = bounded(
        10.0, 3600.0, "seconds in an hour", "seconds of wall time a transfer (an "
        "asynchronous load until finished_recving, a delayed free until "
        "finished_sending) may stay in flight after 40 engine steps without "
        "progress before the contract tier calls it one that never finishes; vLLM "
        "sets no bound: raise it for a slower store", least=1)
    test_timeout_s: float = bounded(
        1800.0, 86_400.0, _DAY, "seconds one contract test may take "
        "(pytest-timeout, signal method) unless --timeout is given", least=10)

    @staticmethod
    def _variables(info: ValidationInfo) -> dict[str, int | float]:
        return rule_variables(info.data.get("extra_config", {}))

    @field_validator("name")
    @classmethod
    def _name(cls, name: str, info: ValidationInfo) -> str:
        if _final(info) and not name.isidentifier():
            raise Refusal(f"{shorten(name)} must be the connector's class name (a "
                          "Python identifier)")
        return name

    @field_validator("kv_role")
    @classmethod
    def _kv_role(cls, role: str, info: ValidationInfo) -> str:
        if _final(info) and role not in KV_ROLES:
            raise Refusal(f"{shorten(role)} is not one of {', '.join(KV_ROLES)}")
        return role

    @field_validator("required_extra_config_keys")
    @classmethod
    def _required(cls, keys: list[str], info: ValidationInfo) -> list[str]:
        for key in keys if _final(info) else ():
            if not key or any(not part for part in key.split(".")):
                raise Refusal(f"{shorten(key)} is not a key or dotted path")
            extra = info.data.get("extra_config", {})
            if not checks.get_extra_config_key(extra, key)[0]:
                raise Refusal(f"{shorten(key)} is missing, and "
                              "connector.required_extra_config_keys names it (a "
                              "required key the profile does not set cannot be "
                              "checked)", "connector.extra_config")
        return keys

    @field_validator("kv_transfer")
    @classmethod
    def _kv_transfer(cls, fields: dict[str, Any], info: ValidationInfo
                     ) -> dict[str, Any]:
        for key in fields if _final(info) else ():
            if key in KV_TRANSFER_RESERVED:
                raise Refusal(f"set by {KV_TRANSFER_RESERVED[key]}; write it there "
                              "instead", f"connector.kv_transfer.{key}")
            if not key.isidentifier():
                raise Refusal(f"{checks.key_name(key)} is not a KVTransferConfig "
                              "field")
        return fields

    @field_validator("hit_rule")
    @classmethod
    def _hit_rule(cls, rule: str, info: ValidationInfo) -> str:
        if _final(info) and rule:
            checks.check_rule(rule, cls._variables(info),
                              extra_config=info.data.get("extra_config", {}))
            _tick(info, "connector.hit_rule")
        return rule

    @field_validator("hit_rules")
    @classmethod
    def _hit_rules(cls, rules: list[HitRule], info: ValidationInfo) -> list[HitRule]:
        for i, entry in enumerate(rules if _final(info) else ()):
            where = f"connector.hit_rules[{i}].rule"
            checks.check_rule(entry.rule, cls._variables(info), where,
                              info.data.get("extra_config", {}))
            _tick(info, where)
        return rules

    @field_validator("granularity")
    @classmethod
    def _granularity(cls, expr: str, info: ValidationInfo) -> str:
        if _final(info):
            checks.check_granularity(expr, cls._variables(info))
        return expr

    @field_validator("hit_log_level")
    @classmethod
    def _log_level(cls, level: str, info: ValidationInfo) -> str:
        if _final(info) and level and level.upper() not in LOG_LEVELS:
            raise Refusal(f"{shorten(level)} is not one of {', '.join(LOG_LEVELS)} "
                          "(or empty)")
        return level.upper() if _final(info) else level

    @field_validator("fault_injector", "worker_report")
    @classmethod
    def _hook(cls, hook: str, info: ValidationInfo) -> str:
        standin = info.field_name == "worker_report"
        if _final(info) and hook and not (standin and hook in (
                "standin", "real-only")) and not _HOOK.fullmatch(hook):
            also = "\"standin\", \"real-only\", " if standin else ""
            raise Refusal(f"{shorten(hook)} must be empty, {also}or 'module:function'")
        return hook

    @field_validator("hit_log_pattern")
    @classmethod
    def _log_pattern(cls, pattern: str, info: ValidationInfo) -> str:
        return _regex(pattern, info, "connector.hit_log_pattern")

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if _final(info):
            checks.check_connector_env(env)
        return env

    @field_validator("worker_devices")
    @classmethod
    def _devices(cls, devices: list[str], info: ValidationInfo) -> list[str]:
        for dev in devices if _final(info) else ():
            if dev not in WORKER_DEVICES:
                raise Refusal(f"{shorten(dev)} is not one of "
                              f"{', '.join(WORKER_DEVICES)} (the devices the contract "
                              "tier's worker harness allocates KV caches on)")
        return devices


class ModelSection(Section):
    """``[model]``: the model the servers load."""

    path: str = Field("", description="local model directory (relative: to this "
                      "file); empty = build a tiny model")


class VllmSection(Section):
    """``[vllm]``: the vLLM under test and how its servers run."""

    source_tree: str = Field("", description="expected editable vLLM source tree; "
                             "empty = any")
    serve_args: list[str] = Field([], description="extra arguments for vllm serve")
    tensor_parallel_sizes: list[int] = Field(
        [1], description=f"tensor-parallel sizes to test: 1 to {MAX_TP_SIZES} sizes "
        f"of 1 to {MAX_TP_SIZE}")
    pipeline_parallel_sizes: list[int] = Field(
        [1], description=f"pipeline-parallel sizes the connector claims (each "
        "worker registers its stage's layers): 1 to "
        f"{MAX_TP_SIZES} sizes of 1 to {MAX_TP_SIZE}; 2 runs the contract tier's "
        "PP round trip")
    env: dict[str, Any] = Field(
        {}, description="environment of the vLLM servers (strings), also read for "
        "the contract tier's model-runner and KV-layout decision, e.g. "
        "{ VLLM_USE_V2_MODEL_RUNNER = \"0\" }")

    @field_validator("tensor_parallel_sizes", "pipeline_parallel_sizes")
    @classmethod
    def _tp(cls, sizes: list[int], info: ValidationInfo) -> list[int]:
        if not _final(info):
            return sizes
        if not sizes or any(n < 1 for n in sizes):
            raise Refusal(f"{shorten(sizes)} must list sizes of 1 or more")
        if len(sizes) > MAX_TP_SIZES or max(sizes) > MAX_TP_SIZE:
            raise Refusal(f"{shorten(sizes)} must list at most {MAX_TP_SIZES} sizes "
                          f"of at most {MAX_TP_SIZE} (GPUs of one parallel group)")
        return sizes

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if _final(info):
            checks.check_vllm_env(env)
        return env


class ImportsSection(Section):
    """``[imports]``: modules the target needs besides vLLM."""

    modules: list[str] = Field([], description="modules the target needs besides "
                               "vLLM")
    hint: str = Field("", description="what to do when one of them does not import")
    extensions: list[str] = Field(
        [], description="compiled extension modules the connector loads, imported "
        "by level1 (an ABI mismatch names the missing symbol); empty = every "
        "extension module of the distributions holding connector.module_path and "
        "the modules above")

    @field_validator("modules", "extensions")
    @classmethod
    def _dotted(cls, names: list[str], info: ValidationInfo) -> list[str]:
        for name in names if _final(info) else ():
            if not name or not all(p.isidentifier() for p in name.split(".")):
                raise Refusal(f"{shorten(name)} is not a dotted module name")
        return names


class DaemonSection(Section):
    """``[daemon]``: a storage daemon the store needs, and what it brings up."""

    kernel_module: str = Field("", description="kernel module that must be loaded")
    argv: list[str] = Field([], description="daemon command line, as a list")
    env: dict[str, Any] = Field({}, description="extra environment for the daemon")
    cwd: str = Field("", description="daemon working directory")
    log_file: str = Field("", description="daemon log file, in scratch (relative: "
                          "to scratch)")
    device_globs: list[str] = Field([], description="device nodes the daemon brings "
                                    "up")

    @field_validator("log_file")
    @classmethod
    def _log_file(cls, value: str, info: ValidationInfo) -> str:
        if not (_final(info) and value):
            return value
        return checks.scratch_file(value, Path(info.context["scratch"]))  # type: ignore[index]
    mount_globs: list[str] = Field([], description="mount points that must be "
                                   "non-empty")
    start_timeout_s: float = bounded(60.0, 3600.0, "seconds in an hour",
                                  "seconds to wait for nodes and mounts")
    nvme_preset: str = Field("", description="JSON preset naming the disks one GPU "
                             "uses")


class ScratchSection(Section):
    """``[scratch]``: the suite-owned folder runs write in."""

    dir: str = Field("", description="suite-owned scratch directory (absolute; "
                     "${SCRATCH} in other keys); default .scratch/<name> in a "
                     "checkout, else $XDG_CACHE_HOME/tutti-vllm-conformance/<name>")


class StoreSection(Section):
    """``[store]``: the GPU-direct store of the store tiers."""

    factory: str = Field("tvc.store.gpu_direct:open_kvikio_store",
                         description="module:function opening the GPU-direct store "
                         "(tvc/store/gpu_direct.py)")
    path: str = Field("", description="pool location for the store tiers (relative: "
                      "to this file); empty = no store")
    pool_bytes: int = bounded(1 << 30, 1 << 46, "bytes (64 TiB) of the disks of one "
                           "machine", "bytes of the pool the real_nvme tier builds")
    options: dict[str, Any] = Field({}, description="keyword arguments passed to the "
                                    "factory")
    test_devices: list[str] = Field([], description="device nodes, or folders the "
                                    "suite creates (new, or marked by an earlier "
                                    "run), where stores outside scratch may write")

    @field_validator("path")
    @classmethod
    def _path(cls, path: str, info: ValidationInfo) -> str:
        return str(checks.owned_dir(path)) if _final(info) and path else path

    @field_validator("test_devices")
    @classmethod
    def _devices(cls, devices: list[str], info: ValidationInfo) -> list[str]:
        return checks.check_test_devices(devices) if _final(info) else devices


class BandwidthSection(Section):
    """``[bandwidth]``: the operators' graded GB/s expectations (their only home)."""

    num_disks: int = bounded(1, 64, "disks of one machine", "disks the store uses "
                          "(chooses the threshold)")
    single_disk_gbps: float = bounded(7.0, 1000.0, "GB/s", "GB/s expected of one disk")
    numa_node_gbps: float = bounded(28.0, 1000.0, "GB/s", "GB/s expected of one NUMA "
                                 "node's 4 disks")
    machine_gbps: float = bounded(50.0, 10_000.0, "GB/s", "GB/s expected of the whole "
                               "machine (8 disks)")
    require_gds: bool = Field(False, description="fail unless the I/O path is "
                              "GPU-direct")


class BuildSection(Section):
    """``[build]``: the build preflight of level1."""

    preflight: bool = Field(False, description="run the build preflight checks "
                            "(level1)")
    min_free_gib: float = bounded(50.0, 1 << 20, "GiB (1 PiB)", "GiB free needed in "
                               "TMPDIR and PIP_CACHE_DIR")
    min_gcc: str = Field("11.3", description="oldest host GCC the build accepts")


class TraceSection(Section):
    """``[trace]``: the trace-replay tier."""

    path: str = Field("", description="Mooncake-format JSONL trace (relative: to "
                      "this file); empty = tvc/data/traces/smoke.jsonl")
    size: str = Field("smoke", description="smoke (served model) or large (8B-class "
                      "dummy)")
    tokens_per_hash_id: int = bounded(0, MAX_CONTEXT_TOKENS, _CONTEXT, "tokens per "
                                   "trace hash id; 0 = by size")
    time_scale: float = bounded(1.0, 1000.0, "a replay time factor", "stream mode: "
                             "send time = timestamp x this")
    max_duration_s: float = bounded(60.0, 86_400.0, _DAY, "stream mode: drop later "
                                 "requests (s)")
    concurrency: int = bounded(4, 1024, _IN_FLIGHT, "requests in flight at most")
    max_requests: int = bounded(0, 1_000_000, "requests of one replay", "replay the "
                             "first N trace records; 0 = all")
    max_output_tokens: int = bounded(0, MAX_CONTEXT_TOKENS, _CONTEXT, "cap on "
                                  "output_length; 0 = by size")
    min_ttft_gain: float = bounded(0.0, 1000.0, "a TTFT ratio", "fail below this p50 "
                                "TTFT gain; 0 = report")
    request_timeout_s: float = bounded(300.0, 86_400.0, _DAY, "per-request timeout in "
                                    "seconds")
    num_gpu_blocks_override: int = bounded(0, 10_000_000, "KV blocks of one GPU",
                                        "GPU KV blocks; 0 = vLLM's own sizing")
    pressure: bool = Field(False, description="size the GPU cache so the trace "
                           "evicts")


class E2eSection(Section):
    """``[e2e]``: the two-pass end-to-end checks."""

    prompt_tokens: int = bounded(600, MAX_CONTEXT_TOKENS, _CONTEXT, "prompt length of "
                              "the two-pass checks (tokens)", least=2)
    concurrency: int = bounded(16, 1024, _IN_FLIGHT, "requests in flight in the "
                            "concurrent check", least=1)
    boundary_repeats: int = bounded(3, 64, "prompts sent twice each at every "
                                    "boundary length", "fresh prompts per block-"
                                    "boundary length (4B-1, 4B, 4B+1) in the "
                                    "two-pass check", least=1)
    baseline: bool = Field(True, description="compare against a server without the "
                           "connector")
    logprob_atol: float = bounded(0.1, 100.0, "a logprob difference", "absolute "
                               "logprob tolerance vs the baseline")
    seed: int = bounded(0, 2**32 - 1, "seeds are 32-bit (numpy, torch)", "prompt seed; "
                     "0 = random per run, recorded")
    load_failure_fault: str = Field(
        "fail_load", description="tvc.contract.faults mode of the load-failure "
        "test: fail_load (a reported failure); the self-tests set misreport_load or "
        "corrupt_load, which must make it fail")

    @field_validator("load_failure_fault")
    @classmethod
    def _fault(cls, mode: str, info: ValidationInfo) -> str:
        if _final(info) and mode not in LOAD_FAILURE_FAULTS:
            raise Refusal(f"{shorten(mode)} is not one of "
                          f"{', '.join(LOAD_FAILURE_FAULTS)}")
        return mode


class PdSection(Section):
    """``[pd]``: a prefill/decode pair (tvc/pd/pair.py, suites/pd)."""

    enabled: bool = Field(False, description="the connector runs as a "
                          "kv_producer/kv_consumer pair (pd tier)")
    routing: str = Field("shared_store", description="request_id, "
                         "kv_transfer_params or shared_store (tvc/pd/pair.py)")
    producer_gpu: int = bounded(0, 1023, "a GPU index", "GPU of the kv_producer server")
    consumer_gpu: int = bounded(1, 1023, "a GPU index", "GPU of the kv_consumer server")
    producer: dict[str, Any] = Field({}, description="KVTransferConfig fields for "
                                     "the producer only")
    consumer: dict[str, Any] = Field({}, description="KVTransferConfig fields for "
                                     "the consumer only")
    prefill_max_tokens: int = bounded(1, MAX_CONTEXT_TOKENS, _CONTEXT, "tokens the "
                                   "router asks of the producer")


class KnownFailure(Section):
    """One ``[[known_failures]]`` entry: an upstream defect its tests xfail on."""

    test: str = Field(description="node-id glob of the tests concerned, starting "
                      "with 'suites/'")
    reason: str = Field(description="the upstream defect, one sentence")
    link: str = Field(description="http(s) URL of the upstream issue")
    vllm: str = Field("", description="PEP 440 specifier of affected vLLM versions; "
                      "empty = all")
    match: str = Field("", description="regex the test's failure must contain (the "
                       "defect's symptom); a failure without it is reported as a "
                       "failure; empty = any failure of the test body")

    @field_validator("test")
    @classmethod
    def _test(cls, test: str, info: ValidationInfo) -> str:
        if _final(info) and not test.strip():
            raise Refusal("empty (a node-id glob, e.g. "
                          "'suites/e2e/test_x.py::test_y*')")
        if _final(info) and not test.lstrip().startswith("suites/"):
            # "*" would turn every failure of the run into an expected one
            raise Refusal(f"{shorten(test)} must name the tests of one defect, "
                          "starting with 'suites/' (e.g. "
                          "'suites/e2e/test_x.py::test_y*')")
        return test

    @field_validator("reason")
    @classmethod
    def _reason(cls, reason: str, info: ValidationInfo) -> str:
        if _final(info) and not reason.strip():
            raise Refusal("empty (name the upstream defect)")
        return reason

    @field_validator("link")
    @classmethod
    def _link(cls, link: str, info: ValidationInfo) -> str:
        if not _final(info):
            return link
        parts = urlsplit(link) if not any(ch.isspace() for ch in link) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise Refusal(f"{shorten(link)} is not an http(s) URL of the upstream "
                          "issue")
        return link

    @field_validator("match")
    @classmethod
    def _match(cls, pattern: str, info: ValidationInfo) -> str:
        return _regex(pattern, info, "known_failures.match")

    @field_validator("vllm")
    @classmethod
    def _vllm(cls, spec: str, info: ValidationInfo) -> str:
        return checks.check_specifier(spec) if _final(info) and spec else spec


class Pairing(Section):
    """One ``package.pairings`` entry: versions that work with a vLLM, or cannot."""

    vllm: str = Field(description="PEP 440 specifier of the vLLM versions the "
                      "entry is for")
    torch: str = Field("", description="PEP 440 specifier of the torch versions; "
                       "empty = any")
    requires: list[str] = Field(description="PEP 508 requirements of the pairing, "
                                "e.g. [\"lmcache==0.5.3\"]")
    works: bool = Field(True, description="true: known to work (seen); false: "
                        "cannot work (e.g. no wheel for that torch)")
    why: str = Field(description="the reason, one sentence: what was seen, or what "
                     "is missing")

    @field_validator("vllm")
    @classmethod
    def _vllm(cls, value: str, info: ValidationInfo) -> str:
        return checks.check_specifier(value) if _final(info) else value

    @field_validator("torch")
    @classmethod
    def _torch(cls, value: str, info: ValidationInfo) -> str:
        return checks.check_specifier(value) if _final(info) and value else value

    @field_validator("requires")
    @classmethod
    def _requires(cls, reqs: list[str], info: ValidationInfo) -> list[str]:
        for req in reqs if _final(info) else ():
            checks.check_requirement(req)
        return reqs

    @field_validator("why")
    @classmethod
    def _why(cls, why: str, info: ValidationInfo) -> str:
        if _final(info) and not why.strip():
            raise Refusal("empty (say what was seen or what is missing)")
        return why


class PackageSection(Section):
    """``[package]``: the distribution the connector comes from, and its pairings."""

    name: str = Field("", description="distribution name of the connector's package "
                      "(e.g. lmcache); empty = vLLM's own connector")
    pairings: list[Pairing] = Field(
        [], description="package versions known to work (or not) with each vLLM: "
        "[{vllm = \"==0.28.0\", requires = [\"lmcache==0.5.6\"], why = \"...\"}]; "
        "the run names the matching entry in one line before any test")


KV_SERVER_KINDS = ("lmcache", "mooncake_master")


class KvServerSection(Section):
    """``[kv_server]``: the connector's own server, started once per session."""

    kind: str = Field("", description="lmcache (LMCache's multiprocess server, for "
                      "LMCacheMPConnector) or mooncake_master (Mooncake's master, "
                      "for MooncakeStoreConnector); empty = none",
                      examples=list(KV_SERVER_KINDS))
    args: list[str] = Field([], description="extra command-line arguments")
    env: dict[str, Any] = Field({}, description="extra environment of the server "
                                "(strings)")
    start_timeout_s: float = bounded(60.0, 3600.0, "seconds in an hour", "seconds "
                                     "to wait for the server to answer")

    @field_validator("kind")
    @classmethod
    def _kind(cls, kind: str, info: ValidationInfo) -> str:
        if _final(info) and kind and kind not in KV_SERVER_KINDS:
            raise Refusal(f"{shorten(kind)} is not one of "
                          f"{', '.join(KV_SERVER_KINDS)} (or empty)")
        return kind


class ProfileModel(Section):
    """A whole profile: its sections and its ``[[known_failures]]``."""

    profile: ProfileSection
    connector: ConnectorSection
    model: ModelSection = ModelSection()
    vllm: VllmSection = VllmSection()
    imports: ImportsSection = ImportsSection()
    daemon: DaemonSection = DaemonSection()
    scratch: ScratchSection = ScratchSection()
    store: StoreSection = StoreSection()
    bandwidth: BandwidthSection = BandwidthSection()
    build: BuildSection = BuildSection()
    trace: TraceSection = TraceSection()
    e2e: E2eSection = E2eSection()
    pd: PdSection = PdSection()
    package: PackageSection = PackageSection()
    kv_server: KvServerSection = KvServerSection()
    known_failures: list[KnownFailure] = Field(
        [], description="upstream defects of this connector class: their tests "
        "xfail, inherited by an extending profile of the same class")

    @model_validator(mode="after")
    def _store_paths(self, info: ValidationInfo) -> ProfileModel:
        if _final(info):
            # resolved once: what the suite checked is what the connector gets
            self.connector.extra_config = checks.resolve_store_paths(
                self.connector.extra_config,
                Path(info.context["scratch"]),  # type: ignore[index]
                self.store.test_devices)
        return self


SECTIONS: dict[str, type[Section]] = {
    name: f.annotation for name, f in ProfileModel.model_fields.items()  # type: ignore[misc]
    if name != "known_failures"
}
REQUIRED = object()  # the default of a required key in SCHEMA
_TAGS: dict[Any, Any] = {str: str, int: int, float: float, bool: bool,
                         list[str]: "list[str]", list[int]: "list[int]",
                         dict[str, Any]: "dict", list[HitRule]: "list[dict]",
                         list[Pairing]: "list[dict]"}


def _default(info: FieldInfo) -> Any:
    return REQUIRED if info.is_required() else info.get_default(
        call_default_factory=True)


# section -> key -> (type, default or REQUIRED, description): a plain view of the models
SCHEMA: dict[str, dict[str, tuple[Any, Any, str]]] = {
    section: {key: (_TAGS[f.annotation], _default(f), f.description or "")
              for key, f in model.model_fields.items()}
    for section, model in SECTIONS.items()
}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a profile file, for editors."""
    out = {"$schema": "https://json-schema.org/draft/2020-12/schema",
           **ProfileModel.model_json_schema(),
           "title": "tvc profile",
           "description": "A target profile of tutti-vllm-conformance (a TOML file; "
           "docs/profiles.md). Strings may hold ${VAR} references, so values are "
           "checked in full by the suite when it loads the profile."}
    # a file that extends another may leave out what its base sets
    out.pop("required", None)
    for definition in out.get("$defs", {}).values():
        if definition.get("title") in ("ConnectorSection", "ProfileSection"):
            definition.pop("required", None)
    return out


_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean",
               "list[str]": "list of strings", "list[int]": "list of integers",
               "list[dict]": "list of tables", "dict": "table"}


def number(value: float) -> str:
    """A bound for people: ``1000000`` rather than ``1e+06`` or ``1000000.0``."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _upper(text: str) -> str:
    return text[:1].upper() + text[1:]


def _row(key: str, f: FieldInfo) -> str:
    default = _default(f)
    shown = "required" if default is REQUIRED else f"`{json.dumps(default)}`"
    limit = ""
    extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
    for m in f.metadata:
        if getattr(m, "le", None) is not None:
            limit = f" (at most {number(m.le)}: {extra.get('x-limit', '')})"
        if getattr(m, "ge", None):
            limit = f" (at least {m.ge})" + limit
    text = (f.description or "").replace("|", "\\|") + limit
    return f"| `{key}` | {_TYPE_NAMES[_TAGS[f.annotation]]} | {shown} | {text} |"


def markdown() -> str:
    """The key table of ``docs/profiles.md``: one table per section, from the models."""
    lines: list[str] = []
    models: list[tuple[str, type[Section]]] = [
        *((f"[{name}]", model) for name, model in SECTIONS.items()),
        ("connector.hit_rules entries", HitRule),
        ("package.pairings entries", Pairing),
        ("[[known_failures]]", KnownFailure)]
    for title, model in models:
        lead = (model.__doc__ or "").split("\n")[0].replace("``", "`")
        lines += [f"### {title}", "", _upper(lead.split("`: ", 1)[-1]), "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        lines += [_row(key, f) for key, f in model.model_fields.items()]
        lines.append("")
    return "\n".join(lines)


SCHEMA_FILE = Path(__file__).resolve().parents[1] / "data" / "profile.schema.json"
DOCS_FILE = Path(__file__).resolve().parents[2] / "docs" / "profiles.md"
DOCS_BEGIN = "<!-- generated by python -m tvc.config.schema --write: begin -->"
DOCS_END = "<!-- generated: end -->"


def schema_text() -> str:
    """The text of ``tvc/data/profile.schema.json``."""
    return json.dumps(json_schema(), indent=2) + "\n"


def docs_text(current: str) -> str:
    """``docs/profiles.md`` with its generated block replaced by :func:`markdown`."""
    head, _, rest = current.partition(DOCS_BEGIN)
    _, _, tail = rest.partition(DOCS_END)
    return f"{head}{DOCS_BEGIN}\n{markdown()}{DOCS_END}{tail}"


def main(argv: list[str]) -> int:
    """``python -m tvc.config.schema [--markdown | --write]``."""
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
    elif argv == ["--write"]:
        SCHEMA_FILE.write_text(schema_text())
        DOCS_FILE.write_text(docs_text(DOCS_FILE.read_text()))
    elif not argv:
        sys.stdout.write(schema_text())
    else:
        sys.stderr.write("usage: python -m tvc.config.schema [--markdown | --write]\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
