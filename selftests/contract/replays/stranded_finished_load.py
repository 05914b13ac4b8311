"""The preemption family's fixed sequence (``tvc.contract.explore._stranded_load``)
on cpu-offload: a finished asynchronous load queued behind a request that holds
no block (vLLM 0.26 / 0.28: a scheduler deadlock).

Prints one JSON line: ``outcome`` (green / red), ``text`` (the failure), ``vllm``.
"""

import json

import vllm

from tvc.contract.explore import ExplorationFailure, _stranded_load, replay_explorer

ex = replay_explorer("cpu-offload", family="preemption", policy="recompute")
text = ""
try:
    _stranded_load(ex)
except ExplorationFailure as exc:
    text = str(exc)
finally:
    ex.close()
print(json.dumps({"outcome": "red" if text else "green", "text": text,
                  "vllm": vllm.__version__}))
