"""A CI red of the panel member chunked-256 (vLLM 0.28.0), replayed.

The preemption family queued ten requests of up to 544 tokens on a rig that
schedules 40 tokens a step; draining them took 200 steps, all making progress,
the last one emptying the scheduler. The suite judged after 200 steps anyway
and called it "every load finishes broken" with nothing left to name.
Now only steps without progress count.

Prints one JSON line: ``outcome`` (green / red), ``text`` (the failure),
``drain_steps`` (steps of the final drain), ``max_steps``, ``vllm``.
"""

import json
import tempfile
from pathlib import Path

import vllm

from tvc.contract.explore import ExplorationFailure, replay_explorer

PROFILE = """\
[profile]
name = "panel-chunked-256"
[connector]
name = "SyncPanelConnector"
module_path = "panel_connectors"
kv_role = "kv_both"
extra_config = { store_path = "${SCRATCH}/panel-store", chunk_tokens = 256 }
granularity = "max(chunk_tokens, B)"
hit_rule = "(len - 1) // max(chunk_tokens, B) * max(chunk_tokens, B)"
hit_rule_source = "selftests/contract/panel_connectors.py"
persistent_store = true
worker_devices = ["cpu"]
[scratch]
dir = "%s"
"""

tmp = Path(tempfile.mkdtemp(prefix="tvc-replay-"))
prof = tmp / "panel-chunked-256.toml"
prof.write_text(PROFILE % (tmp / "scratch"))
ex = replay_explorer(str(prof), family="preemption", policy="recompute")
text, before = "", 0
try:
    ex.warm([(3, 5)], tenant=None)
    ex.crowd(replay_of=None)
    for _ in range(3):
        ex.add(chunks=2, tail=16, prefix_of=1, prefix_blocks=None, twin=False,
               tenant=None, max_tokens=24, replay_of=None)
    for c in (2, 2, 0):
        ex.add(chunks=c, tail=2, prefix_of=None, prefix_blocks=2, twin=True,
               tenant=None, max_tokens=8, replay_of=None)
    ex.add(chunks=0, tail=1, prefix_of=None, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=24, replay_of=1)
    ex.add(chunks=1, tail=16, prefix_of=None, prefix_blocks=6, twin=False,
           tenant=None, max_tokens=2, replay_of=None)
    ex.add(chunks=0, tail=1, prefix_of=None, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=2, replay_of=7)
    before = ex.stats.steps
    ex.finish()
except ExplorationFailure as exc:
    text = str(exc)
finally:
    ex.close()
print(json.dumps({"outcome": "red" if text else "green", "text": text,
                  "drain_steps": ex.stats.steps - before - 4,
                  "max_steps": ex.rig.driver.max_steps, "vllm": vllm.__version__}))
