"""A CI red of the panel member sync-16 (vLLM 0.28.0), replayed.

In the preemption family (a pool of 9 blocks of 16 tokens) a replay of a replay
grew to a 109-token prompt; with 20 output tokens it held 129 tokens, was
preempted, and could never be admitted again (9 blocks > 8 usable). The drain
blamed the connector: "every load finishes" broken, "get_finished
(finished_recving never reported)". vLLM never gets there: its startup makes the
KV cache hold one max_model_len sequence. Now a replay is cut to the explorer's
longest prompt, which fits the pool with its decode.

Prints one JSON line: ``outcome`` (green / red), ``text`` (the failure),
``longest`` (tokens of the longest request), ``usable`` (tokens the pool holds).
"""

import json

from panel_replay import panel_explorer

from tvc.contract.explore import ExplorationFailure

ex = panel_explorer("panel-sync-16", "SyncPanelConnector", 16, "preemption",
                    "recompute")
text = ""
try:
    ex.warm([(3, 12), (3, 16)], tenant=None)
    for tail, twin, max_tokens, of in [(16, False, 1, 5), (1, True, 1, 0),
                                       (16, False, 1, 2), (16, True, 8, 5),
                                       (16, False, 24, 4)]:
        ex.add(chunks=0, tail=tail, prefix_of=None, prefix_blocks=None, twin=twin,
               tenant=None, max_tokens=max_tokens, replay_of=of)
        ex.drain()
        ex.reset_prefix_cache()
except ExplorationFailure as exc:
    text = str(exc)
finally:
    longest = max(len(t) for t in ex.prompts)
    usable = (ex.num_blocks - 1) * 16
    ex.close()
print(json.dumps({"outcome": "red" if text else "green", "text": text,
                  "longest": longest, "usable": usable}))
