"""A CI red of the panel member delayed-free-16 (vLLM 0.28.0), replayed.

In the faults family an injected load failure (policy ``fail``) hit a 17-token
replay that loaded its first 16 tokens; a 32-token prompt sharing that block
through vLLM's local prefix cache computed its tokens 16-31 in the same step,
and vLLM failed both, rolling the second back to 16 computed tokens. The
connector had stored the chunk the worker computed (its KV was written), and a
later replay matched 32 tokens: the explorer said "no hit nobody stored", since
it counted a request's computed tokens only after ``update_from_output``. It now
counts what each step computed (``StepRecord.computed``).

Prints one JSON line: ``outcome`` (green / red), ``text`` (the failure),
``hit`` (the replay's external hit in tokens), ``failed`` (requests vLLM failed).
"""

import json

from panel_replay import panel_explorer

from tvc.contract.explore import ExplorationFailure

ex = panel_explorer("panel-delayed-free-16", "DelayedFreePanelConnector", 16,
                    "faults", "fail")
text = ""
try:
    ex.warm([(1, 1), (1, 1), (1, 1)], tenant=None)
    for chunks, tail, prefix_of, of in [(0, 1, None, 0), (0, 1, None, None),
                                        (0, 1, None, None), (1, 16, 0, None),
                                        (0, 16, 0, None), (0, 16, 0, None)]:
        ex.add(chunks=chunks, tail=tail, prefix_of=prefix_of, prefix_blocks=None,
               twin=False, tenant=None, max_tokens=1, replay_of=of)
    ex.fault("fail", "matched")
    ex.reset_prefix_cache()
    ex.reset_prefix_cache()
    ex.drain()
    ex.reset_prefix_cache()
    ex.add(chunks=0, tail=2, prefix_of=None, prefix_blocks=None, twin=False,
           tenant=None, max_tokens=1, replay_of=6)
    ex.finish()
except ExplorationFailure as exc:
    text = str(exc)
finally:
    matched = ex.rig.driver.matched
    last = sorted(matched, key=lambda r: int(r.rsplit("-", 1)[1]))[-1]
    hit = max(n or 0 for _, n, _ in matched[last])
    failed = sorted(r for r, q in ex.reqs.items() if q.status.name == "FINISHED_ERROR")
    ex.close()
print(json.dumps({"outcome": "red" if text else "green", "text": text, "hit": hit,
                  "failed": failed}))
