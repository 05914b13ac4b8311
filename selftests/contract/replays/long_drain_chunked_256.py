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

import vllm
from panel_replay import panel_explorer

from tvc.contract.explore import ExplorationFailure

ex = panel_explorer("panel-chunked-256", "SyncPanelConnector", 256, "preemption",
                    "recompute")
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
