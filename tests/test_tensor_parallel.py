"""Tensor parallel on the CPU (vLLM's CPU backend, one core a rank): W4A8 served by anychip on two ranks.

The default model (SmolLM2-135M) has 9 attention heads and 3 KV heads: vLLM refuses to split it over two ranks,
and this machine has two cores. So these tests use models whose heads do split: a small random Llama quantized
with anychip (so its BF16 source exists for the noise floor), and `prepare --synthetic tiny` (the default
model's tokenizer and chat template) for the chat request through `anychip serve`.

Numerics: a row-parallel shard quantizes its input with the whole token's scale (tensor_parallel.py), so TP = 2
computes the checkpoint's INT8 values; what remains is BF16 rounding (partial sums are all-reduced in BF16 and
summed in another order). The tolerance is that BF16 noise floor, measured the same way in the same test: the BF16
source model, TP = 1 against TP = 2. W4A8 amplifies a BF16 difference when it moves an activation to the other
INT8 neighbour (the next layer re-quantizes what the BF16 all-reduce rounded), so its floor is a multiple of the
BF16 one: measured here on 47 prompt positions, W4A8 TP1 vs TP2 differed by mean 0.0092 / max 0.0247 nats where
BF16 differed by 0.0032 / 0.0120 (2.9x / 2.1x). The bounds are 4x the mean and 3x the max of the BF16 floor
measured in the same run; a routing or sharding error (a rank serving the wrong rows, a scale from the wrong
group) moves logprobs by tenths of a nat or more. The INT8 values themselves are checked exactly, two ranks against
the unsharded reference, in test_plugin_unit.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.coverage import check

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TEXT = " ".join(f"w{(i * 37) % 97}" for i in range(48))  # words of the tiny models' tokenizer
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def prompt_logprobs(model: Path, out: Path, tp: int, env: dict[str, str] | None = None) -> list[float]:
    cmd = [sys.executable, str(ROOT / "tests" / "vllm_runner.py"), str(model), str(out), "--max-tokens", "2",
           "--prompt", TEXT, "--prompt-logprobs", "--tensor-parallel-size", str(tp), "--max-model-len", "256"]
    full = {**os.environ, **(TP_ENV if tp > 1 else {"VLLM_CPU_KVCACHE_SPACE": "1"}), **(env or {})}
    proc = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())["outputs"][0]["prompt_logprobs"]


def _gap(a: list[float], b: list[float]) -> tuple[float, float]:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(diffs), sum(diffs) / len(diffs)


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory) -> tuple[Path, Path]:
    """(BF16, W4A8 G64) of one random Llama with 4 heads / 2 KV heads, hidden 256, intermediate 512."""
    bf16 = tiny_llama(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return bf16, quantize_checkpoint(bf16, tmp_path_factory.mktemp("tp") / "w4a8", W4A8Scheme(group_size=64))


def test_w4a8_on_two_ranks_matches_one_within_the_bf16_noise_floor(pair, tmp_path):
    bf16, w4a8 = pair
    cov = tmp_path / "coverage.json"
    w1 = prompt_logprobs(w4a8, tmp_path / "w1.json", 1)
    w2 = prompt_logprobs(w4a8, tmp_path / "w2.json", 2, {"ANYCHIP_COVERAGE": str(cov)})
    b1 = prompt_logprobs(bf16, tmp_path / "b1.json", 1)
    b2 = prompt_logprobs(bf16, tmp_path / "b2.json", 2)
    (w_max, w_mean), (b_max, b_mean), (q_max, q_mean) = _gap(w1, w2), _gap(b1, b2), _gap(w1, b1)
    note = (f"W4A8 TP1 vs TP2: max {w_max:.4f} mean {w_mean:.4f}; BF16: max {b_max:.4f} mean {b_mean:.4f}; "
            f"W4A8 vs BF16 (one rank): max {q_max:.4f} mean {q_mean:.4f} (nats)")
    print(note)
    # Two ranks add their row-parallel partial sums in another order, which moves a few activations across an INT8
    # rounding boundary; at single positions quantization amplifies that beyond BF16's own two-rank noise (with
    # vLLM CPU's AMX attention, seen here: W4A8 max 0.037 against BF16's 0.009, mean 0.0085 against 0.0030). So the
    # mean stays bound by BF16's noise (a 1.25x scale on the row-parallel linears gave mean 0.0131 here, over the
    # bound), and the largest single difference by a quarter of what quantization itself moves (W4A8 against BF16,
    # one rank). The whole-token INT8 scale is checked bit for bit in
    # test_plugin_unit.py::test_row_parallel_shards_quantize_with_the_whole_token_scale.
    assert w_mean <= 4 * b_mean + 1e-3 and w_max <= max(3 * b_max + 1e-2, q_max / 4), note
    # coverage: one index naming both ranks; each rank prepared every linear for the fast route and ran it
    index = json.loads(cov.read_text())
    assert index["tensor_parallel"]["world_size"] == 2 and set(index["ranks"]) == {"0", "1"}
    config = json.loads((w4a8 / "config.json").read_text())
    linears = 4 * config["num_hidden_layers"]
    for rank in ("0", "1"):
        doc = json.loads((tmp_path / index["ranks"][rank]).read_text())
        assert doc["tensor_parallel"] == {"rank": int(rank), "world_size": 2}
        assert check(doc, expect_linears=linears) == []
        assert all(r.startswith("cpu.") for r in doc["route_stats"]["by_route"])
        down = doc["layers"]["model.layers.0.mlp.down_proj"]
        assert down["k"] == config["intermediate_size"] // 2  # the row-parallel shard
    ok = subprocess.run([sys.executable, "-m", "anychip.cli", "coverage", "check", str(cov), "--expect-linears",
                         str(linears)], capture_output=True, text=True)
    assert ok.returncode == 0 and "2 tensor-parallel ranks" in ok.stdout, ok.stdout + ok.stderr
    (tmp_path / index["ranks"]["1"]).unlink()
    gone = subprocess.run([sys.executable, "-m", "anychip.cli", "coverage", "check", str(cov)],
                          capture_output=True, text=True)
    assert gone.returncode == 1 and "rank 1" in gone.stdout


def test_anychip_serve_two_ranks_answers_a_chat(tmp_path):
    """The front door: `anychip serve MODEL --tensor-parallel-size 2` (its profile binds one core a rank)."""
    import time
    import urllib.request

    from serve_process import anychip_serve

    from anychip.bench.server import free_port
    from anychip.checkpoint.synthetic import PRESETS, make_synthetic

    model = make_synthetic(PRESETS["tiny"], cache=Path(os.environ.get("ANYCHIP_CACHE") or ROOT / ".cache/models")).path

    port, cov = free_port(), tmp_path / "serve-coverage.json"
    args = ["--coverage", str(cov), "--verify", "fast", "--tensor-parallel-size", "2", "--enforce-eager",
            "--max-model-len", "1024"]
    url = f"http://127.0.0.1:{port}/v1"
    with anychip_serve(model, port, args, tmp_path / "serve.log", 900):
        body = json.dumps({"model": model.name, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Name a colour."}]}).encode()
        req = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
        # random weights: the words are noise, but the request is answered with generated tokens
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] >= 1 and answer["usage"]["prompt_tokens"] > 5
        time.sleep(1.5)  # the ranks flush their reports every 0.5 s
        ok = subprocess.run([sys.executable, "-m", "anychip.cli", "coverage", "check", str(cov)],
                            capture_output=True, text=True)
        assert ok.returncode == 0 and "2 tensor-parallel ranks" in ok.stdout, ok.stdout + ok.stderr
