"""The harness decides the model runner and cross-layer availability as vLLM does.

For vLLM 0.26, 0.28 and 0.33 (each in its own interpreter, see
:func:`_interpreters`) and for a dense, two MoE and two sliding-window model
configs, each with ``VLLM_USE_V2_MODEL_RUNNER`` unset, ``0`` and ``1``
(``runner_decision_probe.py``): vLLM's own ``VllmConfig.use_v2_model_runner``,
the harness's :func:`tvc.contract.layout.decide_model_runner` and its
per-version transcription :func:`tvc.contract.layout.mirror_model_runner` must
agree, and match what vLLM's sources say (dense: V2 by default; Mixtral: V1 on
0.26/0.28, V2 on 0.33; Qwen2-MoE: V2, a default-V2 architecture; the variable
wins), and only 0.26/0.28 offer the cross-layer tensor.

Interpreters: the running one; ``<repo>/.venv-0.33/bin/python`` when present;
``TVC_VLLM026_SOURCES`` (a folder holding vLLM 0.26.0's wheel unpacked:
``vllm/`` and ``vllm-0.26.0.dist-info/``) run first on this interpreter's path
(0.26.0's Python on the installed dependencies). ``TVC_VLLM_PYTHONS``
(``python[=path-prefix];...``) adds others. A version that is not reachable
skips, naming how to provide it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.hw_any]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV_0 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
ENV_1 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def _interpreters() -> dict[str, tuple[str, str]]:
    """label -> (python, PYTHONPATH prefix)."""
    out = {"installed": (sys.executable, "")}
    venv33 = REPO / ".venv-0.33" / "bin" / "python"
    if venv33.exists():
        out["venv-0.33"] = (str(venv33), "")
    src = os.environ.get("TVC_VLLM026_SOURCES", "")
    if src:
        out["sources-0.26"] = (sys.executable, src)
    for item in filter(None, os.environ.get("TVC_VLLM_PYTHONS", "").split(";")):
        py, _, prefix = item.partition("=")
        out[item] = (py, prefix)
    return out


_CACHE: dict[str, dict] = {}


def _probe_all(tmp: Path) -> dict[str, dict]:
    """version -> probe result, one subprocess per interpreter (cached)."""
    if _CACHE:
        return _CACHE
    for i, (label, (py, prefix)) in enumerate(_interpreters().items()):
        env = {k: v for k, v in os.environ.items()
               if k != "VLLM_USE_V2_MODEL_RUNNER"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (prefix, str(REPO)) if p)
        proc = subprocess.run(
            [py, str(HERE / "runner_decision_probe.py"), str(tmp / f"vllm-{i}")],
            capture_output=True, text=True, timeout=600, env=env, check=False)
        line = next((ln for ln in proc.stdout.splitlines()
                     if ln.startswith("PROBE-JSON ")), None)
        assert line, f"{label}: probe failed (rc {proc.returncode}):\n" \
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        data = json.loads(line.removeprefix("PROBE-JSON "))
        _CACHE[data["version"]] = data
    return _CACHE


def _expected(version: str, model: str, env: dict[str, str]) -> str:
    """What vLLM's sources say (config/vllm.py use_v2_model_runner)."""
    if env:
        return "V2" if env["VLLM_USE_V2_MODEL_RUNNER"] == "1" else "V1"
    if version.startswith("0.33"):
        return "V2"
    return "V1" if model == "moe" else "V2"


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    return _probe_all(tmp_path_factory.mktemp("probe"))


@pytest.mark.parametrize("version", ["0.26", "0.28", "0.33"])
def test_harness_runner_decision_matches_vllms_own(probes, version) -> None:
    data = next((d for v, d in probes.items() if v.startswith(version + ".")), None)
    if data is None:
        pytest.skip(f"vLLM {version} is not reachable here (have "
                    f"{', '.join(sorted(probes))}): for 0.33 make <repo>/.venv-0.33 "
                    "(scripts/bootstrap.sh with VENV=.venv-0.33), for 0.26 unpack "
                    "its wheel and set TVC_VLLM026_SOURCES, or list interpreters "
                    "in TVC_VLLM_PYTHONS")
    models = {c["model"] for c in data["cases"]}
    assert models == {"dense", "moe", "moe-default-v2", "sliding-window",
                      "sliding-window-all"}, models
    assert any(c["facts"]["is_moe"] for c in data["cases"]), "no MoE config probed"
    wrong = []
    for c in data["cases"]:
        want = _expected(data["version"], c["model"], c["env"])
        got = (c["vllm"], c["harness"][0], c["mirror"])
        if got != (want, want, want) or c["harness"][1] != "vllm":
            wrong.append(f"{c['model']} env={c['env']}: vLLM {c['vllm']}, harness "
                         f"{c['harness']}, mirror {c['mirror']}, sources say {want}")
    assert not wrong, "\n".join(wrong)
    cross = {c["cross_layer_api"] for c in data["cases"]}
    assert cross == {version != "0.33"}, (
        f"vLLM {data['version']}: cross-layer API present = {cross}")


def test_mirror_disagrees_when_a_rule_is_dropped(monkeypatch) -> None:
    """Negative control: a transcription that forgets the MoE rule of 0.26/0.28
    (every model on V2 by default) is caught by the comparison above."""
    from tvc.contract import layout

    facts = layout.ModelFacts(architectures=("MixtralForCausalLM",), is_moe=True)
    assert layout.mirror_model_runner("0.28.0", facts, {}) == "V1"
    monkeypatch.setattr(layout, "_DEFAULT_V2_ARCHITECTURES",
                        frozenset({"MixtralForCausalLM"}))
    assert layout.mirror_model_runner("0.28.0", facts, {}) == "V2"
    assert _expected("0.28.0", "moe", {}) == "V1"
