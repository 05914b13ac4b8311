"""The box and the build: hardware probe, installed vLLM, toolchain, model."""
