"""Ground-floor helpers: paths, ownership, files (no pytest imports)."""
