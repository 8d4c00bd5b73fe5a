"""anychip's vLLM plugin: the only room that imports vLLM.

Registered as a `vllm.general_plugins` entry point, so a plain `vllm serve DIR` or `LLM(DIR)` loads it in every
vLLM process; `VLLM_PLUGINS` set to a list without "anychip" leaves it out.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Entry point: register the W4A8 quantization config (idempotent; vLLM calls it once per process)."""
    global _registered
    if _registered:
        return
    from anychip.kernels.machine import request_amx_tiles
    from anychip.vllm_plugin import compat, fusion
    from anychip.vllm_plugin.config import AnychipW4A8Config  # noqa: F401  (registers on import)

    request_amx_tiles()  # before any attention runs: see there
    fusion.install()  # RMSNorm (SiluAndMul) -> W4A8 linear, among vLLM's compile passes
    compat.install_cpu_model_hook(_on_cpu_model)  # vLLM's CPU attention from C++ for W4A8 models
    _registered = True


def _on_cpu_model(model: object, vllm_config: object) -> None:
    """A model vLLM's CPU runner loaded: a W4A8 one served by this plugin gets anychip's CPU attention calls."""
    from anychip.vllm_plugin import cpu_attention
    from anychip.vllm_plugin.config import AnychipW4A8Config

    if isinstance(getattr(vllm_config, "quant_config", None), AnychipW4A8Config):
        cpu_attention.adopt(model, vllm_config)
