"""A CI red of the panel member full-prompt-64-async (vLLM 0.28.0), replayed.

Under ``kv_load_failure_policy = "fail"``, req-2's asynchronous load into
blocks [5, 6, 7, 8] was reported failed, and vLLM ended req-2 FINISHED_ERROR
before it computed. Its block 8 went to req-3 and was freed when req-3 ended.
Later, req-5's load into [7, 6, 5, 13] failed as well. The harness still held
req-2's table of the first load, matched the newly reported blocks against it,
and wrote its failed-load mark into block 8 while it was free. Then it blamed
the connector: "no write into a free block". Now the table of an asynchronous
load is dropped when its request ends (``finished_req_ids``).

Prints one JSON line: ``outcome`` (green / red), ``text`` (the failure),
``failed_loads_reported``, ``vllm``.
"""

import json

import vllm
from panel_replay import CHUNK_RULE, panel_explorer

from tvc.contract.explore import ExplorationFailure

FULL_RULE = f"len - 1 if len % max(chunk_tokens, B) == 0 else {CHUNK_RULE}"
ex = panel_explorer("panel-full-prompt-64-async", "AsyncFullPromptPanelConnector",
                    64, "faults", "fail", rule=FULL_RULE)
text = ""
try:
    ex.warm([(1, 1)], tenant=None)
    ex.fault("fail", "matched")
    ex.drain()
    ex.reset_prefix_cache()
    ex.add(chunks=0, tail=16, prefix_of=None, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=1, replay_of=7)
    ex.step(1)
    ex.add(chunks=0, tail=1, prefix_of=None, prefix_blocks=None, twin=False,
           tenant=None, max_tokens=1, replay_of=0)
    ex.drain()
    ex.reset_prefix_cache()
    ex.add(chunks=0, tail=1, prefix_of=None, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=1, replay_of=0)
    ex.fault("corrupt", "matched")
    ex.restart()
except ExplorationFailure as exc:
    text = str(exc)
finally:
    ex.close()
print(json.dumps({"outcome": "red" if text else "green", "text": text,
                  "failed_loads_reported": ex.stats.failed_loads_reported,
                  "vllm": vllm.__version__}))
