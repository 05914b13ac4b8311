"""The connector-API contract tests and the coverage table, proved on known targets.

- :class:`ReportingExampleConnector` (correct: stats, events, reset, skip-reading
  miss, a folder per model) passes every test of
  ``suites/contract/test_connector_api.py``, and the run's
  ``summary.json`` / summary page carry the coverage table;
- each bad connector of ``api_bad_connectors.py`` fails exactly its test, on its
  check;
- the coverage inventory lists the installed base class's methods at the lines
  where ``base.py`` defines them, reports a method or field the suite does not
  know as new, and strict mode (``--tvc-require coverage``) fails a run that never
  exercised a method the connector overrides.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.hw_any

EXAMPLE_RULE = "0 if (len - 1) % B == 0 else (len - 2) // B * B"
PROFILE = """\
[profile]
name = "api-{cls}"
[connector]
name = "{cls}"
module_path = "api_bad_connectors"
kv_role = "kv_both"
extra_config = {{ shared_storage_path = "{store}" }}
hit_rule = "{rule}"
hit_rule_source = "ExampleConnector (the API connectors' base)"
worker_devices = ["cpu"]
[scratch]
dir = "{scratch}"
"""


def _run(cls: str, select: str, tmp_path: Path, *extra: str
         ) -> tuple[subprocess.CompletedProcess, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    prof = tmp_path / f"api-{cls}.toml"
    prof.write_text(PROFILE.format(cls=cls, store="${SCRATCH}/store",
                                   scratch=tmp_path / "scratch", rule=EXAMPLE_RULE))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TVC_PROFILE", "TVC_REQUIRE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])
    report = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/contract/test_connector_api.py",
         "-m", "contract", "-k", select, f"--tvc-profile={prof}",
         "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
         f"--tvc-report-dir={report}", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    path = report / "summary.json"
    return proc, (json.loads(path.read_text()) if path.is_file() else {})


def _out(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


# connector -> (test selection, text its failure must contain)
CASES = {
    "StatsNeverResetConnector": (
        "stats and cpu", "the counters are never reset"),
    "StatsWrongTypeConnector": (
        "stats and cpu", "returned dict, not a KVConnectorStats"),
    "PhantomEventConnector": (
        "events and cpu", "which no request of this run computed"),
    "ResetNoopConnector": (
        "reset and cpu", "the connector's cache was not reset"),
    # an emitter that misses one block is red; one whose events are off skips
    "MissesOneEventConnector": (
        "events and cpu", "was never announced by a BlockStored event"),
    # a prompt extending a stored one: its first new block needs its parent
    "SkipsParentConnector": (
        "events and cpu", "names no parent for block "),
    # the right block in the wrong form: its own message, not "no request..."
    "RawHashEventConnector": (
        "events and cpu", "vLLM's raw BlockHash bytes of a block this run computed, "
        "but vLLM publishes the converted external hash"),
    # push work that never drains: vLLM's engine would step for ever
    "PushNeverDrainsConnector": (
        "stats and cpu", "has_pending_push_work() still answered True"),
}


def _scheduler_guards_skip_reading() -> bool:
    """Whether the installed scheduler zeroes the connector's answer itself.

    vLLM 0.33's ``Scheduler.schedule`` checks ``request.skip_reading_prefix_cache``
    right after ``get_num_new_matched_tokens``; 0.28's does not.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler)
    call = src.find("self.connector.get_num_new_matched_tokens(")
    return call >= 0 and "skip_reading_prefix_cache" in src[call:call + 600]


@pytest.mark.parametrize("cls", sorted(CASES))
def test_api_check_catches_known_bad_connector(cls, tmp_path) -> None:
    select, needle = CASES[cls]
    proc, _ = _run(cls, select, tmp_path)
    out = _out(proc)
    assert proc.returncode == 1, (
        f"{cls}: the API test did not fail (exit {proc.returncode}); expected "
        f"{needle!r}.\n{out}")
    assert needle in proc.stdout + proc.stderr, (
        f"{cls}: failed, but not on the expected check ({needle!r}).\n{out}")


def test_skip_reading_check_catches_a_connector_that_ignores_it(tmp_path) -> None:
    proc, _ = _run("IgnoresSkipReadingConnector", "must_not_read and cpu", tmp_path)
    out = proc.stdout + proc.stderr
    if _scheduler_guards_skip_reading():
        # this vLLM zeroes the answer itself: the request reads nothing cached
        assert proc.returncode == 0 and "2 passed" in out, _out(proc)
        return
    assert proc.returncode == 1 and out.count(
        "the connector ignores Request.skip_reading_prefix_cache") >= 2, _out(proc)


def test_correct_reporting_connector_passes_and_summary_has_the_table(
        tmp_path) -> None:
    proc, summary = _run("ReportingExampleConnector", "cpu", tmp_path)
    assert proc.returncode == 0, _out(proc)
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in summary["tests"]}
    # every test of the file ran to a pass on CPU (none skipped: the connector has
    # stats, events, reset, a skip-reading miss, a folder per model and dtype)
    cpu = {n: o for n, o in outcomes.items() if "cuda" not in n}
    assert len(cpu) >= 16 and set(cpu.values()) == {"passed"}, cpu
    scen = {t["nodeid"].split("::")[-1]: t["properties"].get("scenario")
            for t in summary["tests"]}
    stats = scen["test_stats_are_per_interval_and_usable_by_vllms_logger[cpu]"]
    events = scen["test_kv_cache_events_name_only_stored_blocks[cpu]"]
    assert stats["non_empty_checked"] > 0 and events["stored"] > 0, scen
    cov = summary["coverage"]
    rows = {r["key"]: r for r in cov["rows"]}
    for key in ("api:KVConnectorBase_V1.get_kv_connector_stats",
                "api:KVConnectorBase_V1.take_events",
                "api:KVConnectorBase_V1.reset_cache",
                "api:KVConnectorStats.aggregate",
                "request:SamplingParams.prompt_logprobs",
                "layer:FullAttentionSpec"):
        assert rows[key]["status"] == "exercised", rows[key]
    # one block size only: driven, but the setting was never changed
    block = rows["config:CacheConfig.block_size"]
    assert block["status"] == "not exercised" and block["inputs"] == ["16"], block
    assert rows["api:KVConnectorBase_V1.take_events"]["overridden"] is True
    assert cov["connector"].endswith("ReportingExampleConnector")
    page = (tmp_path / "report" / "summary.md").read_text()
    assert "Connector API and KV-setting coverage" in page
    assert "`api:KVConnectorBase_V1.get_kv_connector_stats`" in page


def test_strict_coverage_fails_an_overridden_method_never_exercised(
        tmp_path) -> None:
    select = "cpu"
    loose, summary = _run("UnusedHookConnector", select, tmp_path / "loose")
    assert loose.returncode == 0, _out(loose)
    missing = summary["coverage"]["missing_overridden"]
    assert missing == ["api:KVConnectorBase_V1.handle_preemptions"], missing
    strict, summary = _run("UnusedHookConnector", select, tmp_path / "strict",
                           "--tvc-require", "coverage")
    out = strict.stdout + strict.stderr
    assert strict.returncode == 1, _out(strict)
    assert "coverage FAILED (strict)" in out and "handle_preemptions" in out, (
        _out(strict))
    assert summary["run"]["outcome"] == "failed"
    # every test passed: junit.xml and the page must still say the gate failed
    import xml.etree.ElementTree as ET

    for run_dir, red in ((tmp_path / "strict" / "report", True),
                         (tmp_path / "loose" / "report", False)):
        suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
        gate = [c for c in suite.iter("testcase") if c.get("name") ==
                "tvc-run-outcome"]
        assert len(gate) == red, (run_dir, ET.tostring(suite)[-2000:])
        page = (run_dir / "summary.md").read_text()
        assert "INCOMPLETE" not in page, page[:600]
    strict_suite = ET.parse(tmp_path / "strict" / "report" / "junit.xml").getroot()
    (case,) = [c for c in strict_suite.iter("testcase")
               if c.get("name") == "tvc-run-outcome"]
    msg = case.find("failure").get("message")
    assert msg.startswith("run failed: coverage gate (--tvc-require coverage) "
                          "failed") and "handle_preemptions" in msg, msg
    page = (tmp_path / "strict" / "report" / "summary.md").read_text()
    assert page.startswith("# Conformance run: FAIL") and "coverage gate" in page


# --------------------------------------------------------------- inventory
def test_inventory_lists_the_installed_base_class_at_its_lines() -> None:
    """Every public member of vLLM's KVConnectorBase_V1 is listed at its def line.

    Checked against the text of ``base.py``: the listed line is the member's
    ``def`` line or a decorator directly above it.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from tvc.contract.coverage import NEW, coverage_table, inventory

    members = {m.key: m for m in inventory()}
    text = Path(inspect.getsourcefile(base)).read_text().splitlines()
    public = [n for n, v in vars(base.KVConnectorBase_V1).items()
              if not n.startswith("_") and (callable(v) or isinstance(
                  v, (property, classmethod, staticmethod)))]
    assert len(public) >= 30, public
    for name in public:
        m = members[f"api:KVConnectorBase_V1.{name}"]
        path, line = m.source.rsplit(":", 1)
        assert path == "vllm/distributed/kv_transfer/kv_connector/v1/base.py", m
        i = int(line) - 1
        while text[i].strip().startswith("@"):
            i += 1
        assert re.match(rf"\s+def {name}\(", text[i]), (name, m.source, text[i])
    cov = coverage_table([])
    assert not [k for k in cov["new"] if k.startswith("api:")], (
        f"the suite does not know these connector API entries of this vLLM: "
        f"{cov['new']}")
    assert NEW not in {r["status"] for r in cov["rows"] if r["kind"] == "api"}


def test_a_new_base_method_and_a_new_field_are_reported_as_new(monkeypatch
                                                               ) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from tvc.contract import coverage as C

    def fancy_new_hook(self, request):  # a method a future vLLM might add
        return None

    monkeypatch.setattr(KVConnectorBase_V1, "fancy_new_hook", fancy_new_hook,
                        raising=False)
    owners = [o for o in C.OWNERS if o.name == "KVConnectorBase_V1"] + [
        C.Owner("config", __name__, "CacheConfig", "dataclass")]
    cov = C.coverage_table([], C.inventory(owners))
    rows = {r["key"]: r for r in cov["rows"]}
    new = rows["api:KVConnectorBase_V1.fancy_new_hook"]
    assert new["status"] == C.NEW and new["source"].endswith(
        f"test_connector_api_checks.py:{fancy_new_hook.__code__.co_firstlineno}"), new
    assert "api:KVConnectorBase_V1.fancy_new_hook" in cov["new"]
    assert rows["config:CacheConfig.brand_new_knob"]["status"] == C.NEW
    assert rows["config:CacheConfig.block_size"]["status"] != C.NEW
    assert "config:CacheConfig.gpu_memory_utilization" not in rows  # reviewed


@dataclasses.dataclass
class CacheConfig:
    """A stand-in for a future vLLM's CacheConfig with one field more."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    brand_new_knob: int = 0


def test_a_connector_whose_events_are_off_is_not_checked_for_events(
        tmp_path) -> None:
    proc, summary = _run("EventsOffConnector", "events and cpu", tmp_path)
    assert proc.returncode == 0, _out(proc)
    t = next(t for t in summary["tests"] if "kv_cache_events" in t["nodeid"])
    assert t["outcome"] == "skipped", t
    assert "emitted no KV cache event in the whole scenario" in t["message"], t
    assert "not an event emitter" in t["message"], t
    assert "never announced" not in _out(proc), _out(proc)


def test_push_work_is_drained_before_the_replay(tmp_path) -> None:
    """vLLM steps while ``has_pending_push_work`` (``Scheduler.has_requests``): a
    store visible only once its push drained is found by the replay."""
    proc, summary = _run("PushDrainsLaterConnector", "stats and cpu", tmp_path)
    assert proc.returncode == 0, _out(proc)
    (t,) = [t for t in summary["tests"] if "stats" in t["nodeid"]]
    assert t["outcome"] == "passed", t
    assert t["properties"]["scenario"]["hit_tokens"] > 0, t


def test_a_worker_serving_lookups_is_built_first_and_is_the_rigs_own(
        tmp_path) -> None:
    """The worker side before the scheduler side (``EngineCore.__init__``), and a
    ``VLLM_RPC_BASE_PATH`` folder per rig: lookups over a socket named by host only
    reach this rig's worker, in every test of one process."""
    proc, summary = _run("WorkerLookupConnector", "(stats or events or reset) and cpu",
                         tmp_path)
    assert proc.returncode == 0, _out(proc)
    outcomes = {t["nodeid"].split("::")[1]: t["outcome"] for t in summary["tests"]}
    assert list(outcomes.values()).count("passed") == 3, outcomes
    assert not list(Path(tempfile.gettempdir()).glob("tvc-rpc-*/tvc-lookup-*")), \
        "a rig's IPC folder was left behind"


def test_a_rig_ipc_folder_left_by_a_stop_goes_at_exit(tmp_path: Path) -> None:
    """Fresh-user finding: Ctrl-C in the contract tier left an empty ``tvc-rpc-*``
    folder in the temp folder (a rig interrupted before its close). What a rig
    makes, the process removes at exit at the latest."""
    code = ("import sys; from tvc.contract import rig; made = rig._make_rpc_dir(); "
            "closed = rig._make_rpc_dir(); rig._remove_rpc_dir(closed); "
            "print(made, closed); sys.exit(0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    made, closed = (Path(p) for p in proc.stdout.split())
    assert made.parent == tmp_path and made.name.startswith("tvc-rpc-"), made
    assert not made.exists() and not closed.exists()
    assert list(tmp_path.iterdir()) == []
