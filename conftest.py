"""Root conftest: loads the suite's plugin and fixtures (see fixtures/plugin.py)."""

pytest_plugins = [
    "fixtures.plugin",
    "fixtures.run_store",
    "fixtures.vllm_install",
    "fixtures.model",
    "fixtures.vllm_server",
    "fixtures.trace_bench",
    "fixtures.contract",
    "fixtures.daemon",
    "fixtures.store",
]
