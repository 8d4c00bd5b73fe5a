"""anychip: W4A8 serving for small LLMs through stock vLLM, on the intended kernels."""

__version__ = "0.1.0"
