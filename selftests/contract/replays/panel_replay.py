"""The explorer of a panel connector for a replay script (a profile in a temp folder).

The replay scripts run in a fresh interpreter with ``selftests/contract`` (the
panel connectors) and the repository on PYTHONPATH; this folder is the script's
own, so ``from panel_replay import panel_explorer`` finds this module.
"""

import tempfile
from pathlib import Path
from typing import Any

from tvc.contract.explore import replay_explorer

CHUNK_RULE = "(len - 1) // max(chunk_tokens, B) * max(chunk_tokens, B)"

PROFILE = """\
[profile]
name = "{name}"
[connector]
name = "{cls}"
module_path = "panel_connectors"
kv_role = "kv_both"
extra_config = {{ store_path = "${{SCRATCH}}/panel-store", chunk_tokens = {chunk} }}
granularity = "max(chunk_tokens, B)"
hit_rule = "{rule}"
hit_rule_source = "selftests/contract/panel_connectors.py"
persistent_store = true
worker_devices = ["cpu"]
[scratch]
dir = "{scratch}"
"""


def panel_explorer(name: str, cls: str, chunk: int, family: str, policy: str,
                   rule: str = CHUNK_RULE) -> Any:
    """:func:`tvc.contract.explore.replay_explorer` of a panel member.

    Args:
        name: the profile's name.
        cls: a class of ``selftests/contract/panel_connectors.py``.
        chunk: its ``chunk_tokens``.
        family: the exploration family.
        policy: ``kv_load_failure_policy``.
        rule: the hit rule (default: whole chunks, ``len - 1`` excluded).

    """
    tmp = Path(tempfile.mkdtemp(prefix="tvc-replay-"))
    prof = tmp / f"{name}.toml"
    prof.write_text(PROFILE.format(name=name, cls=cls, chunk=chunk, rule=rule,
                                   scratch=tmp / "scratch"))
    return replay_explorer(str(prof), family=family, policy=policy)
