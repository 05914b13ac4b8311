"""The trace tier: Mooncake-format traces, replay modes, the replay campaign."""
