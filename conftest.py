"""Root conftest: makes ``fixtures/`` importable and loads the suite's plugin.

The plugin (:mod:`tvc.plugin`) is normally registered through the ``pytest11`` entry
point of the installed package; a checkout that is not installed loads it from here.
:mod:`tvc.compat_report` (an unsupported vLLM is an error) is always loaded here.
The fixture modules are plain pytest plugins in ``fixtures/``. The repository root is
put on ``sys.path`` so that they load under every ``--import-mode`` (``importlib``
does not add it).
"""

import sys
from importlib.metadata import entry_points
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

_INSTALLED = any(ep.value == "tvc.plugin" for ep in entry_points(group="pytest11"))

pytest_plugins = ([] if _INSTALLED else ["tvc.plugin"]) + [
    "fixtures.vllm",
    "fixtures.model",
    "fixtures.trace",
    "fixtures.contract",
    "fixtures.daemon",
    "fixtures.store",
    "tvc.compat_report",  # HarnessIncompatible -> an error, never a failure
]
