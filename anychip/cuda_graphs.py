"""Which step sizes a GPU engine captures as CUDA graphs: vLLM's own sizes, and a few more for prefill steps.

vLLM captures piecewise CUDA graphs for steps of up to 512 tokens by default (1, 2, 4, then every 8 to 256 and every
16 to 512); a larger step, such as a chunk of a long prompt, launches every kernel from the host. An anychip W4A8
linear launched eagerly costs 65-150 µs of host time on an H100 host (the quantization and the GEMM through two
Python-side Triton launches) where a BF16 linear costs about 16 µs, so eager prefill steps of 4,096 tokens were bound
by the host: 136-154k prompt tokens/s, 178k with the same steps replayed from graphs (docs/gpu-notes.md, session 36).
`capture_sizes` adds four sizes an octave above vLLM's range, up to the engine's step budget (max_num_batched_tokens):
a step is padded to the next size, at most 1.25x its tokens. Pure functions: no vLLM, no torch.
"""

from __future__ import annotations

VLLM_DEFAULT_MAX = 512  # vLLM's largest default capture size (min(max_num_seqs * 2, 512))
PER_OCTAVE = 4  # prefill sizes an octave: 640, 768, 896, 1024, 1280, ...


def vllm_sizes(max_size: int, max_num_tokens: int | None = None) -> list[int]:
    """vLLM's default capture sizes up to `max_size` (its _set_cudagraph_sizes without speculative decoding or
    sequence parallelism): 1, 2, 4, every 8 below 256, every 16 from 256, and max_num_tokens where it fits."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    if max_size >= 8:
        sizes += range(8, min(max_size + 1, 256), 8)
    if max_size >= 256:
        sizes += range(256, max_size + 1, 16)
    if max_num_tokens is not None and max_num_tokens <= max_size:
        sizes.append(max_num_tokens)
    return sorted(set(sizes))


def prefill_sizes(above: int, max_num_tokens: int) -> list[int]:
    """Sizes past `above` up to max_num_tokens: PER_OCTAVE an octave (each octave [2^j, 2^(j+1)] split evenly,
    multiples of 16), then max_num_tokens itself, so that every step up to the budget replays a graph."""
    if max_num_tokens <= above:
        return []
    sizes = []
    base = 1 << max(above, 1).bit_length() - 1  # the octave `above` lies in
    while base < max_num_tokens:
        step = max(16, base // PER_OCTAVE)
        sizes += [s for s in range(base + step, 2 * base + 1, step) if above < s < max_num_tokens]
        base *= 2
    return sorted(set(sizes + [max_num_tokens]))


def capture_sizes(max_num_tokens: int, dense_max: int = VLLM_DEFAULT_MAX) -> list[int]:
    """vLLM's default sizes up to dense_max (capped at the budget), then prefill_sizes up to max_num_tokens."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens={max_num_tokens}: a positive number of tokens")
    dense = min(dense_max, max_num_tokens)
    return sorted(set(vllm_sizes(dense, max_num_tokens) + prefill_sizes(dense, max_num_tokens)))


def vllm_default_max(max_num_seqs: int, max_num_tokens: int, speculative_tokens: int = 0) -> int:
    """vLLM's largest capture size when nobody sets one: twice the decode tokens of max_num_seqs, at most 512, at
    most the step budget."""
    return min(max_num_seqs * (1 + speculative_tokens) * 2, VLLM_DEFAULT_MAX, max_num_tokens)


def extended(sizes: list[int], max_size: int, max_num_tokens: int, default_max: int) -> list[int] | None:
    """The sizes to capture instead of an engine's `sizes` (whose largest is max_size): `capture_sizes` where they
    are exactly vLLM's defaults (max_size its default_max, the list its default for that), None where someone chose
    them (a user's list or largest size is theirs) or where they already reach the budget."""
    if not sizes or max_size != default_max or max_size >= max_num_tokens:
        return None
    if list(sizes) != vllm_sizes(max_size, max_num_tokens):
        return None
    return capture_sizes(max_num_tokens, max_size)
