"""The e2e tier's plan and its two-pass acceptance steps."""
