"""The report wing: run folders read back, tables and pages (no pytest here).

Verdicts, scope, stop reasons, live reds, certification results and the GPU
gate's table; the plugin (:mod:`tvc.plugin`) feeds it values.
"""
