"""Machinery of the suite: profiles, hardware probe, reports, and the fixtures' helpers.

One module per piece (docs/layout.md); tests import from here and never start
processes themselves.
"""
