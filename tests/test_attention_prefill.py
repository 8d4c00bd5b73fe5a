"""anychip's prefill attention kernel (csrc/attention_prefill_x86.h) against a float64 reference, and the plugin's
choice of where it serves. The kernel computes causal attention over steps of fresh prompts from BF16 q, k, v in
fp32 and rounds once to BF16, so it must agree with float64 attention to about one BF16 rounding."""

from __future__ import annotations

import pytest
import torch

from anychip.kernels import cpu_ext
from anychip.kernels.machine import cpu_flags


@pytest.fixture(scope="module")
def op():
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("the prefill kernel needs AVX2 + FMA (x86)")
    cpu_ext.load()
    return torch.ops.anychip.prefill_attention


def reference(q, k, v, starts, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(starts[:-1], starts[1:]):
        qq = q[a:b].double().transpose(0, 1)
        kk = k[a:b].double().transpose(0, 1).repeat_interleave(rep, 0)
        vv = v[a:b].double().transpose(0, 1).repeat_interleave(rep, 0)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                                    scale=scale).transpose(0, 1)
    return out


def fused_qkv(tokens: int, heads: int, kv_heads: int, dim: int, seed: int, spread: float = 2.0):
    """q, k, v as vLLM hands them over: strided views of one (tokens, (H + 2 Hkv) D) projection output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * spread).to(torch.bfloat16)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    return q, k, v


@pytest.mark.parametrize("heads, kv_heads, dim, lens", [
    (9, 3, 64, [512]),  # SmolLM2-135M's attention at pp512
    (4, 4, 32, [1, 5, 17, 100]),  # one-token prompts, lengths across tile edges (6 rows, 16 keys)
    (8, 2, 128, [300, 7]),
    (6, 3, 40, [33, 64]),  # head dim not a multiple of 32
    (2, 1, 256, [50]),
    (16, 8, 64, [6, 16, 96, 97]),
])
def test_matches_float64_attention(op, heads, kv_heads, dim, lens):
    tokens = sum(lens)
    q, k, v = fused_qkv(tokens, heads, kv_heads, dim, seed=tokens + dim)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    out = torch.full((tokens, heads, dim), float("nan"), dtype=torch.bfloat16)
    op(q, k, v, out, torch.tensor(starts, dtype=torch.int32), dim ** -0.5)
    ref = reference(q, k, v, starts, dim ** -0.5)
    assert not out.isnan().any()
    # in units of one BF16 rounding step of the reference value (2^-8 relative; floor for values near zero)
    err = ((out.double() - ref).abs() / (ref.abs().clamp(min=1e-2) * 2.0 ** -8)).max().item()
    assert err <= 2.0, err


def test_sequences_do_not_see_each_other(op):
    """Two sequences in one step: the second's output must not depend on the first's keys."""
    q, k, v = fused_qkv(40, 4, 2, 64, seed=1)
    starts = torch.tensor([0, 24, 40], dtype=torch.int32)
    out = torch.empty(40, 4, 64, dtype=torch.bfloat16)
    op(q, k, v, out, starts, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[:24] = 0
    v2[:24] = 7
    out2 = torch.empty_like(out)
    op(q, k2, v2, out2, starts, 0.125)
    assert torch.equal(out[24:], out2[24:]) and not torch.equal(out[:24], out2[:24])


def test_rows_only_see_earlier_keys(op):
    """Causal: changing key/value row t changes no output row before t."""
    q, k, v = fused_qkv(64, 2, 1, 32, seed=2)
    starts = torch.tensor([0, 64], dtype=torch.int32)
    out = torch.empty(64, 2, 32, dtype=torch.bfloat16)
    op(q, k, v, out, starts, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[40], v2[40] = 5, -5
    out2 = torch.empty_like(out)
    op(q, k2, v2, out2, starts, 0.2)
    assert torch.equal(out[:40], out2[:40]) and not torch.equal(out[40:], out2[40:])


@pytest.mark.parametrize("case, match", [
    ("fp32", "bfloat16"),
    ("dim12", "multiple of 8"),
    ("heads", "multiple of KV heads"),
    ("offsets", "offsets"),
])
def test_refuses_what_it_does_not_compute(op, case, match):
    q, k, v = fused_qkv(16, 4, 2, 16, seed=3)
    out = torch.empty(16, 4, 16, dtype=torch.bfloat16)
    starts = torch.tensor([0, 16], dtype=torch.int32)
    if case == "fp32":
        q = q.float()
    elif case == "dim12":
        q, k, v = (t[..., :12] for t in (q, k, v))
        out = out[..., :12]
    elif case == "heads":
        q, k, v = fused_qkv(16, 3, 2, 16, seed=3)
        out = torch.empty(16, 3, 16, dtype=torch.bfloat16)
    else:
        starts = torch.tensor([0, 20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        op(q, k, v, out, starts, 0.25)


@pytest.mark.parametrize("flags, arch, env, on", [
    ({"avx2", "fma"}, "x86_64", None, True),  # AVX2-only x86: vLLM's kernels are its generic ones
    ({"avx2", "fma", "avx512f"}, "x86_64", None, False),  # vLLM's AVX512 build keeps its own
    ({"avx2", "fma", "avx512f"}, "x86_64", "1", True),  # forced
    ({"avx2", "fma"}, "x86_64", "0", False),
    ({"avx2"}, "x86_64", "1", False),  # no FMA: cannot run
    ({"asimd"}, "aarch64", None, False),
])
def test_plugin_choice(monkeypatch, flags, arch, env, on):
    pytest.importorskip("vllm")
    from anychip.vllm_plugin.cpu_attention import prefill_kernel_choice

    if env is None:
        monkeypatch.delenv("ANYCHIP_ATTN_PREFILL", raising=False)
    else:
        monkeypatch.setenv("ANYCHIP_ATTN_PREFILL", env)
    chosen, why = prefill_kernel_choice(frozenset(flags), arch)
    assert chosen is on and why


def paged(keys: list[torch.Tensor], block: int, blocks: int, seed: int):
    """Each sequence's (len, Hkv, D) keys written into a (blocks, Hkv, block, D) cache at shuffled block ids, as
    vLLM's CPU backend lays it out; returns the cache and the (sequences, max blocks) int32 block table."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, dim = keys[0].shape[1:]
    cache = torch.randn(blocks, kv_heads, block, dim, generator=gen).to(torch.bfloat16)  # stale data elsewhere
    free = torch.randperm(blocks, generator=gen).tolist()
    width = max((len(k) + block - 1) // block for k in keys)
    table = torch.full((len(keys), width + 2), -1, dtype=torch.int32)
    for s, k in enumerate(keys):
        for i in range((len(k) + block - 1) // block):
            b = free.pop()
            table[s, i] = b
            part = k[i * block:(i + 1) * block]
            cache[b, :, :len(part)] = part.transpose(0, 1)
    return cache, table


@pytest.mark.parametrize("heads, kv_heads, dim, context, rows, block", [
    (9, 3, 64, [0, 200, 31], [64, 40, 1], 32),  # a fresh prompt, a chunk after 200 cached tokens, a decode row
    (8, 2, 128, [100], [50], 16),
    (4, 4, 32, [5, 0, 16], [7, 33, 16], 32),
])
def test_paged_cache_matches_float64_attention(op, heads, kv_heads, dim, context, rows, block):
    """Rows whose keys partly sit in vLLM's paged cache (a chunked prefill's later chunk, a prefix-cache hit, a
    decode beside them): queries at positions ctx .. ctx + rows - 1 of their sequence."""
    gen = torch.Generator().manual_seed(dim + sum(rows))
    seqs = [(torch.randn(c + r, heads, dim, generator=gen) * 2).to(torch.bfloat16) for c, r in zip(context, rows)]
    keys = [(torch.randn(c + r, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16) for c, r in zip(context, rows)]
    vals = [(torch.randn(c + r, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16) for c, r in zip(context, rows)]
    kc, table = paged(keys, block, 64, seed=1)
    vc, _ = paged(vals, block, 64, seed=1)  # the same block ids: the seed fixes the permutation
    q = torch.cat([s[c:] for s, c in zip(seqs, context)])
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + r)
    out = torch.full((sum(rows), heads, dim), float("nan"), dtype=torch.bfloat16)
    lens = torch.tensor([c + r for c, r in zip(context, rows)], dtype=torch.int32)
    torch.ops.anychip.prefill_attention_cached(q, kc, vc, out, torch.tensor(starts, dtype=torch.int32), lens, table,
                                               dim ** -0.5)
    rep = heads // kv_heads
    for s, (c, r) in enumerate(zip(context, rows)):
        qq = seqs[s][c:].double().transpose(0, 1)
        kk = keys[s].double().transpose(0, 1).repeat_interleave(rep, 0)
        vv = vals[s].double().transpose(0, 1).repeat_interleave(rep, 0)
        mask = torch.arange(c + r)[None, :] <= (c + torch.arange(r))[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=dim ** -0.5)
        got = out[starts[s]:starts[s + 1]].double().transpose(0, 1)
        err = ((got - ref).abs() / (ref.abs().clamp(min=1e-2) * 2.0 ** -8)).max().item()
        assert err <= 2.0, (s, err)


def test_paged_cache_refuses_a_block_outside_it(op):
    q = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    kc = torch.zeros(3, 1, 8, 16, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    table = torch.tensor([[0, 7]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.anychip.prefill_attention_cached(q, kc, kc.clone(), out, torch.tensor([0, 4], dtype=torch.int32),
                                                   torch.tensor([12], dtype=torch.int32), table, 0.25)
