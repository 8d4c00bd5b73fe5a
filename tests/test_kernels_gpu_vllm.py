"""The CUDA route end to end through vLLM's LLM(...): strict coverage with exact per-phase call counts under CUDA
graphs, and logprobs position by position against the torch reference route, on a small synthetic model.

Skipped without a CUDA device or vLLM. The model is `anychip prepare --synthetic tiny` (made from the default
model's tokenizer), or the directory in ANYCHIP_GPU_MODEL (a CUDA host that cannot prepare the default model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anychip.coverage import check

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA route's vLLM run needs an NVIDIA GPU", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 16
#: |logprob(anychip) - logprob(reference)| of the same token at the same position. Both routes compute the same
#: INT32 group sums; they differ in fp32 (Triton) vs fp64 (reference) accumulation of the rescaled groups, then
#: one bf16 rounding of every linear's output: a few bf16 ulps on the logits.
LOGPROB_TOL = 0.05


@pytest.fixture(scope="module")
def model() -> Path:
    given = os.environ.get("ANYCHIP_GPU_MODEL")
    if given:
        return Path(given)
    from anychip.checkpoint.synthetic import make_synthetic, parse_shape

    from conftest import model_cache

    shape = parse_shape("tiny")
    make_synthetic(shape, cache=model_cache())
    return model_cache() / "synthetic" / shape.dirname


class _Runs(dict):
    """name -> (outputs, coverage); a run that failed raises its stderr when a test asks for it."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[str, str] = {}

    def __getitem__(self, name: str) -> tuple[dict, dict]:
        if name in self.errors:
            pytest.fail(f"the {name} run failed:\n{self.errors[name]}")
        return super().__getitem__(name)


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory) -> _Runs:
    """Strict with CUDA graphs (vLLM's default), strict eager, and the reference route (eager), each a process."""
    tmp = tmp_path_factory.mktemp("gpu_vllm")
    keep = Path(os.environ["ANYCHIP_GPU_KEEP"]) if os.environ.get("ANYCHIP_GPU_KEEP") else None  # device runs
    settings = {"graphs": ({}, True), "eager": ({}, False),
                "reference": ({"ANYCHIP_KERNEL_ISA": "reference", "ANYCHIP_ALLOW_FALLBACK": "1"}, False)}
    out = _Runs()
    for name, (env, compile) in settings.items():
        cov, result = tmp / f"coverage-{name}.json", tmp / f"out-{name}.json"
        cmd = [sys.executable, str(ROOT / "tests" / "vllm_runner.py"), str(model), str(result), "--max-tokens",
               str(MAX_TOKENS), "--logprobs", "5", *(["--compile"] if compile else [])]
        for p in PROMPTS:
            cmd += ["--prompt", p]
        proc = subprocess.run(cmd, env={**os.environ, **env, "ANYCHIP_COVERAGE": str(cov)}, capture_output=True,
                              text=True, timeout=900, check=False)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"stderr-{name}.txt").write_text(proc.stderr[-200_000:])
            for path in (cov, result):
                if path.exists():
                    (keep / path.name).write_text(path.read_text())
        if proc.returncode != 0 or not cov.exists():
            out.errors[name] = proc.stderr[-6000:]
            continue
        out[name] = (json.loads(result.read_text()), json.loads(cov.read_text()))
    return out


def _layers(model: Path) -> tuple[int, int]:
    config = json.loads((model / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    return config["num_hidden_layers"], group


@pytest.mark.parametrize("name", ["graphs", "eager"])
def test_strict_coverage_counts_every_pass(runs, model, name, tmp_path) -> None:
    """Every linear on cuda.triton, and each layer's calls per phase equal the model runner's steps per phase:
    with CUDA graphs the kernels count themselves at replay, where no Python runs."""
    out, cov = runs[name]
    layers, group = _layers(model)
    assert out["quantization"] == "anychip-w4a8"
    assert check(cov, expect_linears=4 * layers, group_size=group) == []
    assert cov["route_stats"]["by_route"] == {"cuda.triton": 4 * layers}
    assert cov["strict"] is True and cov["vllm_tested"] is True
    phases = cov["phases"]
    # all prompts prefill in one step, then one decode step a generated token after the first
    assert phases["decode"]["forward_passes"] == MAX_TOKENS - 1, phases
    assert phases["prefill"]["forward_passes"] >= 1, phases
    for layer_name, layer in cov["layers"].items():
        for phase in ("prefill", "decode"):
            assert layer["calls"][phase] == phases[phase]["forward_passes"], (layer_name, phase, layer["calls"])
        assert layer["tokens"]["decode"] >= len(PROMPTS) * (MAX_TOKENS - 1)  # rows, CUDA-graph padding included
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(cov))
    proc = subprocess.run([sys.executable, "-m", "anychip.cli", "coverage", "check", str(path), "--expect-linears",
                           str(4 * layers), "--group-size", str(group)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "PASSED" in proc.stdout, proc.stdout + proc.stderr


def test_graphs_and_eager_count_the_same(runs) -> None:
    graphs, eager = runs["graphs"][1], runs["eager"][1]
    for phase in ("prefill", "decode"):
        assert graphs["phases"][phase] == eager["phases"][phase]
        assert ({n: layer["calls"][phase] for n, layer in graphs["layers"].items()}
                == {n: layer["calls"][phase] for n, layer in eager["layers"].items()})


def _agreement(a: dict, b: dict) -> tuple[float, int, int]:
    """(max |logprob difference| of the same token up to the first divergence, positions compared, diverged)."""
    worst, compared, diverged = 0.0, 0, 0
    for ra, rb in zip(a["outputs"], b["outputs"], strict=True):
        assert ra["prompt_token_ids"] == rb["prompt_token_ids"]
        for pos, (ta, tb) in enumerate(zip(ra["token_ids"], rb["token_ids"], strict=True)):
            la, lb = ra["logprobs"][pos], rb["logprobs"][pos]
            if str(ta) in lb:
                worst = max(worst, abs(la[str(ta)] - lb[str(ta)]))
            compared += 1
            if ta != tb:  # greedy paths part: later positions see different contexts
                diverged += 1
                gap = abs(lb[str(tb)] - lb.get(str(ta), float("-inf")))
                assert gap <= 2 * LOGPROB_TOL, f"position {pos}: tokens {ta} vs {tb}, reference gap {gap:.3g}"
                break
    return worst, compared, diverged


def test_logprobs_match_reference_route(runs) -> None:
    ref_cov = runs["reference"][1]
    assert set(ref_cov["route_stats"]["by_route"]) == {"reference"}
    for name in ("graphs", "eager"):
        worst, compared, diverged = _agreement(runs[name][0], runs["reference"][0])
        print(f"{name} vs reference: max |dlogprob| {worst:.4g} over {compared} positions, {diverged} diverged")
        assert worst <= LOGPROB_TOL, f"{name}: max |dlogprob| {worst:.4g} > {LOGPROB_TOL}"
        assert compared >= len(PROMPTS) * MAX_TOKENS // 2
