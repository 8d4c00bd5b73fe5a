"""Seeded sampling through LLM(...) on a CPU: vLLM 0.32's CPU model runner rewinds a seeded request's generator
after each prompt chunk the way CUDA's generator allows and a CPU one refuses, which killed the engine; the plugin
restores the generator's state instead (compat.install_cpu_seeded_sampling_fix). A chunked prompt then samples
the same tokens as the same prompt prefilled in one step."""

from __future__ import annotations

import json

import pytest
from conftest import model_cache
from test_plugin import run_llm

pytestmark = pytest.mark.slow
PROMPT = ",".join(str(t) for t in range(5000, 5200))  # 200 token ids: four chunks of a 64-token budget


def _sampled(model, out, budget: int) -> list[int]:
    proc = run_llm(model, out, max_tokens=6, prompts=[],
                   flags=("--prompt-ids", PROMPT, "--sample-seed", "7", "--max-num-batched-tokens", str(budget),
                          "--max-model-len", "512"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = json.loads(out.read_text())["outputs"]
    assert len(row["token_ids"]) == 6
    return row["token_ids"]


def test_seeded_sampling_survives_a_chunked_prompt_and_matches_one_step(tmp_path):
    from anychip.checkpoint.synthetic import PRESETS, make_synthetic

    model = make_synthetic(PRESETS["tiny"], cache=model_cache()).path
    chunked = _sampled(model, tmp_path / "chunked.json", 64)
    whole = _sampled(model, tmp_path / "whole.json", 512)
    assert chunked == whole
