"""Root conftest: makes ``fixtures/`` importable and loads the suite's plugin.

The plugin (:mod:`tvc.plugin`) is normally registered through the ``pytest11`` entry
point of the installed package; a checkout that is not installed (or a run with
plugin autoloading disabled) loads it from here.
:mod:`tvc.compat_report` (an unsupported vLLM is an error) is always loaded here.
The fixture modules are plain pytest plugins in ``fixtures/``. The repository root is
put on ``sys.path`` so that they load under every ``--import-mode`` (``importlib``
does not add it).
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Loaded through the pytest11 entry point, the plugin is imported before any conftest;
# otherwise (not installed, or plugin autoloading disabled) load it from here.
_LOADED = "tvc.plugin" in sys.modules

pytest_plugins = ([] if _LOADED else ["tvc.plugin"]) + [
    "fixtures.vllm",
    "fixtures.model",
    "fixtures.trace",
    "fixtures.contract",
    "fixtures.daemon",
    "fixtures.store",
    "fixtures.pd",
    "tvc.compat_report",  # HarnessIncompatible -> an error, never a failure
]
