"""Which steps a GPU engine captures as CUDA graphs (anychip/cuda_graphs.py), and the plugin's rule for applying
them: pure logic, checked on any machine."""

from __future__ import annotations

import types

import pytest

from anychip import cuda_graphs as cg


def test_vllm_sizes_are_vllms_default_list():
    """51 sizes up to 512 (what vLLM 0.26 captured for a 4,096-token budget: "51/51" in its logs); a budget
    below the largest size is appended as vLLM does."""
    sizes = cg.vllm_sizes(512)
    assert len(sizes) == 51 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 252 not in sizes and 264 not in sizes and 272 in sizes
    assert 300 in cg.vllm_sizes(512, 300) and cg.vllm_sizes(2) == [1, 2] and cg.vllm_sizes(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("budget", [513, 600, 1000, 2048, 3000, 4096, 8192, 16384, 20000])
def test_every_step_up_to_the_budget_pads_by_at_most_a_quarter(budget):
    sizes = cg.capture_sizes(budget)
    assert sizes[:51] == cg.vllm_sizes(512) and sizes[-1] == budget and sizes == sorted(set(sizes))
    extra = sizes[51:]
    assert all(s % 16 == 0 for s in extra[:-1])
    for step in range(513, budget + 1, 7):
        padded = next(s for s in sizes if s >= step)
        assert padded <= 1.25 * step + 16, (step, padded)
    per_octave = sum(1 for s in extra if 1024 < s <= 2048)
    assert budget < 2048 or per_octave == cg.PER_OCTAVE


def test_small_budgets_and_dense_ranges():
    assert cg.capture_sizes(100) == cg.vllm_sizes(100, 100)  # the budget inside vLLM's dense range: nothing added
    assert cg.capture_sizes(512) == cg.vllm_sizes(512)
    one_seq = cg.capture_sizes(640, dense_max=2)  # a batch-one engine: vLLM's [1, 2], then prefill sizes
    assert one_seq[:2] == [1, 2] and one_seq[-1] == 640 and 512 in one_seq
    assert all(b <= 1.25 * a + 16 for a, b in zip(one_seq[2:], one_seq[3:]))
    with pytest.raises(ValueError):
        cg.capture_sizes(0)


def test_extended_only_replaces_vllms_own_default():
    default = cg.vllm_sizes(512)
    assert cg.vllm_default_max(256, 4096) == 512 and cg.vllm_default_max(4, 4096) == 8
    assert cg.vllm_default_max(256, 300) == 300 and cg.vllm_default_max(64, 4096, speculative_tokens=3) == 512
    assert cg.extended(default, 512, 4096, 512) == cg.capture_sizes(4096)
    assert cg.extended([s for s in default if s != 64], 512, 4096, 512) is None  # a user's list
    assert cg.extended(cg.vllm_sizes(256), 256, 4096, 512) is None  # the user's --max-cudagraph-capture-size 256
    assert cg.extended(cg.vllm_sizes(8), 8, 4096, 8) == cg.capture_sizes(4096, 8)  # max_num_seqs 4: vLLM's 8
    assert cg.extended(default + [4096], 4096, 4096, 512) is None  # already reaches the budget
    assert cg.extended(cg.vllm_sizes(256, 256), 256, 256, 256) is None
    assert cg.extended([], 0, 4096, 512) is None  # no graphs at all (eager)


def _config(sizes, budget=4096, quant=True, mode="FULL_AND_PIECEWISE", compile_sizes=()):
    from vllm.config.compilation import CUDAGraphMode

    cc = types.SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, mode), compile_sizes=list(compile_sizes),
                               cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=max(sizes or [0]))
    return types.SimpleNamespace(compilation_config=cc, quant_config="anychip" if quant else None,
                                 num_speculative_tokens=0,
                                 scheduler_config=types.SimpleNamespace(max_num_batched_tokens=budget,
                                                                        max_num_seqs=256))


def test_the_plugin_extends_vllms_default_sizes_for_its_models_on_a_gpu(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from anychip.vllm_plugin import graphs

    serves = lambda config: config.quant_config == "anychip"  # noqa: E731
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.delenv("ANYCHIP_GPU_PREFILL_GRAPHS", raising=False)
    cfg = _config(cg.vllm_sizes(512))
    assert graphs.extend(cfg, serves)
    assert cfg.compilation_config.cudagraph_capture_sizes == cg.capture_sizes(4096)
    assert cfg.compilation_config.max_cudagraph_capture_size == 4096
    left = [_config(cg.vllm_sizes(512), quant=False),  # a model the plugin does not serve
            _config([1, 2, 4, 8, 1024]),  # the user's sizes
            _config(cg.vllm_sizes(256)),  # the user's largest size (vLLM's default here: 512)
            _config(cg.vllm_sizes(512), mode="FULL"),  # mixed steps would be full graphs
            _config(cg.vllm_sizes(512), mode="NONE"),
            _config(cg.vllm_sizes(512), compile_sizes=[8])]  # compile sizes derived from the capture sizes
    for cfg in left:
        before = list(cfg.compilation_config.cudagraph_capture_sizes)
        assert not graphs.extend(cfg, serves) and cfg.compilation_config.cudagraph_capture_sizes == before
    monkeypatch.setenv("ANYCHIP_GPU_PREFILL_GRAPHS", "0")
    assert not graphs.extend(_config(cg.vllm_sizes(512)), serves)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
    monkeypatch.delenv("ANYCHIP_GPU_PREFILL_GRAPHS")
    assert not graphs.extend(_config(cg.vllm_sizes(512)), serves)  # a CPU engine: no CUDA graphs to size
