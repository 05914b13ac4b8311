# Sourced by the scripts in scripts/gpu/: the GPU host's environment for the suite.
# The vLLM 0.26.0 bundle (/root/vllm-bundle/site, session.sh setup), carried wheels
# (/tmp/site; /tmp/site-real: real.sh setup's lmcache, mc-setup's Mooncake with its
# console scripts in /tmp/site-real/bin and libibverbs in /tmp/site-real-lib), then
# the checkout ($root).
# The host writes no bytecode by default and the bundle has none: PYTHONPYCACHEPREFIX
# gives vLLM's imports a cache (a server start ~50 s -> ~36 s; docs/gpu-host.md).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/root/pyc}
export PYTHONPATH=/tmp/site-real:/tmp/site:/root/vllm-bundle/site:$root${PYTHONPATH:+:$PYTHONPATH} \
  HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
  LD_LIBRARY_PATH=/tmp/site/nvidia/cu13/lib:/tmp/site-real-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  PATH=/tmp/site-real/bin:$PATH
