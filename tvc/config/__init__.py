"""Profiles: loading, pydantic schema, value checks, hit rules, known failures."""
