"""The shrunk replay of ``-k preemption --tvc-profile=cpu-offload
--tvc-seed=1975927298`` (vLLM 0.28.0), as the red printed it.

Prints one JSON line: ``outcome`` (green / red), ``text`` (the failure),
``vllm``, ``max_resume_wait`` (steps a request waited after its receive ended).
"""

import json

import vllm

from tvc.contract.explore import ExplorationFailure, replay_explorer

ex = replay_explorer("cpu-offload", family="preemption", policy="recompute")
text = ""
try:
    ex.add(chunks=2, tail=16, prefix_of=None, prefix_blocks=None, twin=False,
           tenant=None, max_tokens=1, replay_of=None)
    for _ in range(2):
        ex.add(chunks=0, tail=16, prefix_of=None, prefix_blocks=None, twin=False,
               tenant=None, max_tokens=1, replay_of=None)
    for _ in range(7):
        ex.add(chunks=0, tail=1, prefix_of=None, prefix_blocks=None, twin=False,
               tenant=None, max_tokens=1, replay_of=0)
    ex.drain()
    ex.reset_prefix_cache()
    ex.add(chunks=0, tail=1, prefix_of=None, prefix_blocks=None, twin=False,
           tenant=None, max_tokens=1, replay_of=1)
    ex.add(chunks=0, tail=16, prefix_of=2, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=24, replay_of=None)
    ex.add(chunks=0, tail=16, prefix_of=2, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=24, replay_of=None)
    ex.add(chunks=2, tail=16, prefix_of=2, prefix_blocks=None, twin=True,
           tenant=None, max_tokens=24, replay_of=None)
    ex.add(chunks=2, tail=17, prefix_of=0, prefix_blocks=None, twin=False,
           tenant=None, max_tokens=1, replay_of=None)
    ex.finish()
except ExplorationFailure as exc:
    text = str(exc)
finally:
    ex.close()
print(json.dumps({"outcome": "red" if text else "green", "text": text,
                  "vllm": vllm.__version__,
                  "max_resume_wait": ex.stats.max_resume_wait}))
