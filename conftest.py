"""Root conftest of the checkout: loads the suite's plugin when it is not installed.

The plugin (:mod:`tvc.plugin.hooks`) is normally registered through the ``pytest11``
entry point of the installed package, and in a suite run it registers the fixture
modules (:mod:`tvc.fixtures`) and :mod:`tvc.plugin.compat_report` itself
(``SUITE_PLUGINS``). A run with plugin autoloading disabled loads it from here.
"""

import sys

# Loaded through the pytest11 entry point, the plugin is imported before any conftest;
# then this file defines no pytest_plugins (a run from outside the checkout that
# collects suites/ loads it as a non-top-level conftest, where pytest refuses one).
if "tvc.plugin.hooks" not in sys.modules:
    pytest_plugins = ["tvc.plugin.hooks"]
