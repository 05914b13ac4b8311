"""The report wing: run folders read back, tables and pages (no pytest here).

The plugin (:mod:`tvc.plugin`) feeds it values.
"""
