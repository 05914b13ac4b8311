"""Ground-floor helpers with no pytest import: watchdog (deadlines)."""
