"""Ground-floor helpers with no pytest import: paths, ownership, files, deadlines."""
