"""llama.cpp as an `anychip eval` engine: the prefix-reuse schedule, logprobs from logits, the report's targets and
pairs (no llama.cpp needed), and (slow, skipped without llama-cpp-python) the F32 GGUF scoring like the BF16
model through transformers."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from anychip.eval import runner
from anychip.eval.errors import EvalDataError
from anychip.eval.llama_cpp_engine import LlamaCppEngine, gguf_for, prefix_schedule, token_logprobs_from_logits
from anychip.eval.scoring import TaskScore

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_prefix_schedule_keeps_the_shared_prefix_and_decodes_one_token_at_least():
    seqs = [[5, 1, 2], [1, 2, 3, 4], [1, 2, 3], [1, 2, 9], [5, 1, 2]]
    sched = prefix_schedule(seqs)
    assert sorted(i for i, _ in sched) == list(range(len(seqs)))
    # sorted order: [1,2,3] [1,2,3,4] [1,2,9] [5,1,2] [5,1,2]
    assert sched == [(2, 0), (1, 3), (3, 2), (0, 0), (4, 2)]


def test_logprobs_from_logits_match_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 8
    seq = [3, 7, 0, 49, 12, 5]
    got = token_logprobs_from_logits(logits, seq)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    assert got == pytest.approx([ref[j - 1, seq[j]] for j in range(1, len(seq))], abs=1e-9)


class FakeLlama:
    """llama-cpp-python's Llama as LlamaCppEngine uses it (n_tokens, eval, scores), with logits that depend on
    the whole prefix: a cache reused for the wrong tokens changes them."""

    def __init__(self, n_ctx: int = 16, vocab: int = 11) -> None:
        self.n_tokens, self.vocab = 0, vocab
        self.input_ids = np.zeros(n_ctx, dtype=np.int64)
        self.scores = np.zeros((n_ctx, vocab), dtype=np.float32)
        self.decoded = 0

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens) -> None:
        for t in tokens:
            self.input_ids[self.n_tokens] = t
            prefix = tuple(self.input_ids[:self.n_tokens + 1].tolist())
            rng = np.random.default_rng(abs(hash(prefix)) % 2**32)
            self.scores[self.n_tokens] = rng.normal(size=self.vocab)
            self.n_tokens += 1
            self.decoded += 1


def _engine_on(fake: FakeLlama) -> LlamaCppEngine:
    engine = LlamaCppEngine.__new__(LlamaCppEngine)  # no GGUF: the fake stands in for llama.cpp
    engine.llm, engine.max_len = fake, 16
    return engine


def test_prefix_reuse_gives_the_logprobs_of_fresh_evaluation():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3], [7, 8], [1, 2, 3, 4], [1, 9]]
    shared = _engine_on(FakeLlama())
    got = shared.token_logprobs(seqs, desc="test")
    fresh = []
    for s in seqs:
        fake = FakeLlama()
        fake.eval(s)
        fresh.append(token_logprobs_from_logits(fake.scores[:len(s)], s))
    assert got == fresh
    assert shared.llm.decoded < sum(len(s) for s in seqs)  # the prefixes were reused, not decoded again


def test_unknown_llama_cpp_type_names_the_choices(tmp_path):
    with pytest.raises(EvalDataError, match="Q4_0, Q8_0"):
        gguf_for(tmp_path, "Q5_K")


def test_targets_head_int8_and_llama_cpp_peers(tmp_path, monkeypatch):
    import json

    src = tmp_path / "bf16"
    src.mkdir()
    (src / "config.json").write_text("{}")
    q = tmp_path / "w4a8"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({"quantization_config": {
        "format": "pack-quantized", "anychip": {"source": str(src)},
        "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 32, "symmetric": True}}}}}))
    import anychip.eval.llama_cpp_engine as lce

    monkeypatch.setattr(lce, "gguf_for", lambda bf16, ftype: bf16.parent / f"{bf16.name}.{ftype}.gguf")
    targets = runner.targets_to_evaluate(q, compare_bf16=True, head_int8=True, llama_cpp=["Q4_0"])
    by = {t.label: t for t in targets}
    assert list(by)[1:] == ["bf16", "w4a8+head-int8", "llama.cpp-Q4_0"]
    assert by["w4a8+head-int8"].env == (("ANYCHIP_HEAD", "int8"),) and by["w4a8+head-int8"].baseline == "w4a8"
    peer = by["llama.cpp-Q4_0"]
    assert (peer.engine, peer.tokenizer, peer.path.name, peer.baseline) == ("llama.cpp", src, "bf16.Q4_0.gguf", "bf16")


def _result(label: str, bits: str, ppl: float) -> runner.ModelResult:
    outcomes = tuple(float(b) for b in bits)
    return runner.ModelResult(model=label, tasks={"t": TaskScore(outcomes, outcomes)},
                              ppl={"ppl": ppl, "tokens": 10, "nll_per_token": math.log(ppl), "windows": 1})


def test_report_pairs_every_variant_with_its_baseline():
    results = {"w4a8": _result("w", "1100", 20.0), "bf16": _result("b", "1110", 16.0),
               "w4a8+head-int8": _result("h", "1000", 21.0), "llama.cpp-Q4_0": _result("q", "0110", 25.0)}
    report = runner.build_report(results, runner.EvalSettings(), {},
                                 {"w4a8+head-int8": "w4a8", "llama.cpp-Q4_0": "bf16"})
    task, ppl = report["tasks"]["t"], report["tasks"]["perplexity"]
    assert set(task["deltas"]) == {"w4a8 - bf16", "w4a8+head-int8 - w4a8", "llama.cpp-Q4_0 - bf16",
                                   "w4a8 - llama.cpp-Q4_0"}
    assert task["delta"] == task["deltas"]["w4a8 - bf16"] and task["delta"]["acc_norm"] == pytest.approx(-0.25)
    assert task["deltas"]["w4a8+head-int8 - w4a8"]["acc_norm"] == pytest.approx(-0.25)
    assert ppl["deltas"]["w4a8 - llama.cpp-Q4_0"]["ppl_ratio"] == pytest.approx(0.8)
    assert report["items"]["t"]["llama.cpp-Q4_0"] == {"acc": "0110", "acc_norm": "0110"}
    text = runner.format_report(report)
    assert "llama.cpp-Q4_0" in text and "(w4a8+head-int8 - w4a8)" in text


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed: make peers")
def test_llama_cpp_f32_scores_like_transformers_fp32(default_model):
    """The F32 GGUF through llama.cpp against the BF16 weights through transformers in fp32: the same arithmetic
    up to summation order, so logprobs agree closely (a rotary-order or tokenizer mistake would be off by nats)."""
    import torch

    from anychip.eval.engines import TorchEngine

    bf16 = Path(default_model.bf16_dir)
    ours = LlamaCppEngine(gguf_for(bf16, "F32"), bf16, max_len=256)
    try:
        seqs = [[ours.prefix_id, *ours.encode(t)] for t in (
            "The quick brown fox jumps over the lazy dog.",
            "In the beginning was the Word, and the Word was with God.",
            "Question: What is the capital of France?\nAnswer: Paris")]
        got = ours.token_logprobs(seqs, desc="llama.cpp")
    finally:
        ours.close()
    ref = TorchEngine.from_dir(bf16, dtype=torch.float32, max_len=256).token_logprobs(seqs, desc="torch")
    diffs = [abs(a - b) for g, r in zip(got, ref) for a, b in zip(g, r)]
    assert max(diffs) < 0.05, f"max |logprob difference| {max(diffs):.4f} nats"
    assert sum(diffs) / len(diffs) < 0.01
