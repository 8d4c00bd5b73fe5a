"""A damaged W4A8 checkpoint through a plain LLM(...) (no `anychip verify` before it): a NaN in a BF16 norm weight
stops the engine with the parameter named, instead of plausible wrong tokens (the INT8 activations launder it)."""

from __future__ import annotations

import shutil

import pytest
from conftest import model_cache
from test_plugin import run_llm
from test_verify_values import poke

pytestmark = pytest.mark.slow


def test_a_nan_norm_weight_is_refused_at_load(tmp_path):
    from anychip.checkpoint.synthetic import PRESETS, make_synthetic

    d = shutil.copytree(make_synthetic(PRESETS["tiny"], cache=model_cache()).path, tmp_path / "nan-norm")
    poke(d, "model.layers.1.input_layernorm.weight", (2,), float("nan"))  # SHA256SUMS rewritten over it
    proc = run_llm(d, tmp_path / "out.json", max_tokens=2, prompts=[], flags=("--prompt-ids", "1000,1001,1002"))
    assert proc.returncode != 0
    assert "input_layernorm.weight holds NaN or inf" in proc.stderr, proc.stderr[-3000:]
