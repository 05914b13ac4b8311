"""The pytest plugin: hooks and options, run control, reports, summary page."""
