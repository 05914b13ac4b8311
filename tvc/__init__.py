"""Machinery of the suite: profiles, hardware probe, reports, and the fixtures' helpers.

Each module owns one piece (see the README's layout section); tests import from here
and never start processes themselves.
"""
