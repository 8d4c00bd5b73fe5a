"""vLLM's Marlin as a peer in the GPU kernel benchmark (vllm_plugin/marlin_peer.py, bench/kernels_gpu.py).

On any machine: the GPTQ packing Marlin's repack reads, the one-line reason when vLLM's Marlin cannot run, and the
bench's Marlin columns and Markdown when a peer is missing or fails its check. On a CUDA host with vLLM 0.26: each
peer against the torch reference over shapes and group sizes, and the bench's columns with times (skipped, with
the reason, elsewhere).
"""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch

from anychip.bench import kernels_gpu
from anychip.vllm_plugin import marlin_peer

NOT_HERE = "vLLM is not importable (ImportError: test)"


def _weights(n: int, k: int, g: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 31 + k + g)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.002).to(torch.bfloat16)
    return q.to(device), s.to(device)


# --- on any machine -----------------------------------------------------------------------------------------------

def test_gptq_pack_puts_row_8r_plus_i_in_nibble_i() -> None:
    q = torch.stack([torch.arange(-8, 0), torch.arange(0, 8)]).to(torch.int8)  # (N=2, K=8)
    words = marlin_peer.gptq_pack(q)
    assert words.shape == (1, 2) and words.dtype == torch.int32
    assert words[0, 0].item() == 0x76543210  # q + 8 = 0..7, row 0 in the low nibble
    assert words[0, 1].item() == 0xFEDCBA98 - 2**32  # q + 8 = 8..15: the top nibble sets the sign bit


def test_gptq_pack_round_trips() -> None:
    q, _ = _weights(40, 64, 32)
    words = marlin_peer.gptq_pack(q)  # (K // 8, N)
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(64, 40)
    assert torch.equal((nibbles - 8).t().to(torch.int8), q)


def test_gptq_pack_refuses_k_not_a_multiple_of_8() -> None:
    with pytest.raises(ValueError, match="K=12 is not a multiple of 8"):
        marlin_peer.gptq_pack(torch.zeros(4, 12, dtype=torch.int8))


def test_reason_when_vllm_is_not_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    reason = marlin_peer.unavailable_reason()
    assert reason is not None and reason.startswith("vLLM is not importable (") and "\n" not in reason
    assert marlin_peer.vllm_version() is None


def test_reason_for_another_vllm_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    assert marlin_peer.unavailable_reason() == (
        "vLLM 0.32.0 is installed; the Marlin peer is written against vLLM 0.26.x's signatures")


def test_reason_here_is_none_or_one_line() -> None:
    reason = marlin_peer.unavailable_reason()  # whatever this machine has, it answers and does not raise
    assert reason is None or (reason and "\n" not in reason)
    if not torch.cuda.is_available():
        assert reason is not None


def _no_call(*args: object, **kwargs: object) -> None:
    raise AssertionError("must not be called")


def test_bench_columns_without_marlin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marlin_peer, "unavailable_reason", lambda: NOT_HERE)
    monkeypatch.setattr(marlin_peer, "make_marlin", _no_call)
    q, s = _weights(64, 128, 32)
    cols = kernels_gpu.marlin_columns(torch.randn(2, 128, dtype=torch.bfloat16), q, s, 32, copies=3)
    for name in kernels_gpu.MARLIN_PEERS:
        assert cols[f"{name}_skipped"] == NOT_HERE
        assert cols[f"{name}_ms"] is None and cols[f"{name}_rel_err"] is None
        assert cols[f"{name}_speedup_vs_bf16"] is None


def test_a_peer_that_fails_its_check_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(marlin_peer, "unavailable_reason", lambda: None)
    monkeypatch.setattr(kernels_gpu, "graph_ms", _no_call)
    q, s = _weights(64, 128, 32)
    x = torch.randn(3, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    # a peer whose output is off by a few percent, as a wrong scale layout would make it
    monkeypatch.setattr(marlin_peer, "make_marlin", lambda q, s, g, int8_activations: lambda x: (
        kernels_gpu.peer_reference(x, q, s, int8_activations) * 1.05).to(torch.bfloat16))
    cols = kernels_gpu.marlin_columns(x, q, s, 32, copies=2)
    for name in kernels_gpu.MARLIN_PEERS:
        assert cols[f"{name}_ms"] is None
        assert cols[f"{name}_rel_err"] == pytest.approx(0.05, abs=0.005)
        assert re.fullmatch(r"relative error 0\.0[45]\d* > 0\.01 against the torch reference", cols[f"{name}_skipped"])


def test_a_peer_that_raises_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("marlin_gemm: no kernel for this shape\nsecond line")

    monkeypatch.setattr(marlin_peer, "unavailable_reason", lambda: None)
    monkeypatch.setattr(marlin_peer, "make_marlin", refuse)
    q, s = _weights(64, 128, 32)
    cols = kernels_gpu.marlin_columns(torch.randn(1, 128, dtype=torch.bfloat16), q, s, 32, copies=1)
    assert cols["marlin_w4a8_skipped"] == "RuntimeError: marlin_gemm: no kernel for this shape"


def _row(m: int, marlin: dict[str, object]) -> dict[str, object]:
    row: dict[str, object] = {"m": m, "k": 2048, "n": 6144, "group_size": 128, "w4a8_config": "cfg",
                              "speedup_vs_bf16": 0.9, "speedup_vs_int_mm": 0.8}
    for name in ("w4a8", "w4a8_gemm", "bf16", "int_mm"):
        row |= {f"{name}_ms": 0.01, f"{name}_tops": 1.0, f"{name}_weight_gbs": 600.0}
    return row | marlin


def test_markdown_and_json_with_and_without_marlin() -> None:
    missing = {f"{p}{suffix}": None for p in kernels_gpu.MARLIN_PEERS
               for suffix in ("_ms", "_speedup_vs_bf16", "_rel_err")}
    missing |= {f"{p}_skipped": NOT_HERE for p in kernels_gpu.MARLIN_PEERS}
    timed = {"marlin_w4a16_ms": 0.0123, "marlin_w4a16_speedup_vs_bf16": 0.81, "marlin_w4a16_rel_err": 0.0021,
             "marlin_w4a16_skipped": None, "marlin_w4a8_ms": 0.0111, "marlin_w4a8_speedup_vs_bf16": 0.9,
             "marlin_w4a8_rel_err": 0.0034, "marlin_w4a8_skipped": None}
    report = {"command": "python -m anychip.bench.kernels_gpu", "group_size": 128, "copy_gbs": 2800.0,
              "device": {"gpu": "test GPU", "multiprocessors": 132, "memory_gib": 139.8, "torch": "2.11",
                         "cuda": "13.0"},
              "marlin": {"vllm": None, "unavailable": NOT_HERE}, "rows": [_row(1, missing), _row(16, timed)]}
    md = kernels_gpu.markdown(report)
    assert "| 1 | 2048 | 6144 | 0.0100 | 0.0100 | - | - | 0.90x | - | - | - / - |" in md
    assert "| 16 | 2048 | 6144 | 0.0100 | 0.0100 | 0.0123 | 0.0111 | 0.90x | 0.81x | 0.90x | 0.0021 / 0.0034 |" in md
    assert f"- marlin_w4a16 not timed (M=1 K=2048 N=6144): {NOT_HERE}" in md
    report["rows"][1] = _row(16, missing)
    assert f"- marlin_w4a8 not timed (all shapes): {NOT_HERE}" in kernels_gpu.markdown(report)
    assert json.loads(json.dumps(report)) == report


# --- on a CUDA host with vLLM 0.26 --------------------------------------------------------------------------------

@pytest.fixture
def marlin_here() -> None:
    if reason := marlin_peer.unavailable_reason():
        pytest.skip(f"vLLM Marlin peer: {reason}")


@pytest.mark.parametrize("int8", [False, True], ids=["w4a16", "w4a8"])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 7, 64, 512])
@pytest.mark.parametrize(("k", "n"), [(1024, 256), (2048, 576)])
def test_marlin_matches_the_reference(marlin_here: None, k: int, n: int, m: int, g: int, int8: bool) -> None:
    q, s = _weights(n, k, g, "cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(m)).cuda()
    y = marlin_peer.make_marlin(q, s, g, int8_activations=int8)(x)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    err = kernels_gpu.relative_error(y, kernels_gpu.peer_reference(x, q, s, int8))
    assert err <= kernels_gpu.MARLIN_MAX_REL_ERR


def test_marlin_refuses_a_shape_it_would_pad(marlin_here: None) -> None:
    q, s = _weights(96, 256, 128, "cuda")  # N=96 is not a multiple of 64
    with pytest.raises(ValueError, match="K=256 N=96"):
        marlin_peer.make_marlin(q, s, 128)


def test_bench_columns_on_the_gpu(marlin_here: None) -> None:
    q, s = _weights(512, 1024, 128, "cuda")
    x = torch.randn(16, 1024, dtype=torch.bfloat16, device="cuda")
    cols = kernels_gpu.marlin_columns(x, q, s, 128, copies=2)
    for name in kernels_gpu.MARLIN_PEERS:
        assert cols[f"{name}_skipped"] is None, cols[f"{name}_skipped"]
        assert cols[f"{name}_ms"] > 0 and cols[f"{name}_rel_err"] <= kernels_gpu.MARLIN_MAX_REL_ERR
