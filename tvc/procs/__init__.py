"""Processes the suite owns: vllm serve, the storage daemon, the pool, the client."""
