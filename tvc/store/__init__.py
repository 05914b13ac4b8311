"""GPU-direct stores: adapters, checks, bandwidth, run stores, Tutti's stand-in."""
