"""Prefill/decode disaggregation: a producer and a consumer server behind a router."""
