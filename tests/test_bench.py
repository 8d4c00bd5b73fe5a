"""`anychip bench latency / serve`: the metric arithmetic on recorded timings, the peer checkpoints, the reports,
the streaming client against a scripted server, and (slow) one short real run of each. No test asserts a timing."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from anychip import envs
from anychip.bench import latency, metrics, peers, serve
from anychip.bench.metrics import MeanSd, RepTiming, RequestRecord
from anychip.checkpoint.model_dir import ModelDir
from anychip.cli import build_parser, main
from anychip.errors import AnychipError

# ---- latency arithmetic ----


def test_rates_follow_llama_bench():
    pp, tg, total = metrics.rates(512, 128, RepTiming(t_pp=0.25, t_tg=2.0))
    assert pp == pytest.approx(2048.0)
    assert tg == pytest.approx(64.0)
    assert total == pytest.approx(640 / 2.25)


def test_rates_reject_zero_durations():
    with pytest.raises(ValueError, match="non-positive"):
        metrics.rates(1, 1, RepTiming(0.0, 1.0))


def test_mean_sd_is_the_sample_sd():
    s = metrics.mean_sd([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert s.mean == pytest.approx(5.0)
    assert s.sd == pytest.approx(np.std([2, 4, 4, 4, 5, 5, 7, 9], ddof=1))
    assert metrics.mean_sd([3.0]) == MeanSd(3.0, 0.0, 1)
    assert math.isnan(metrics.mean_sd([]).mean)


def test_summarize_latency_averages_per_repetition_rates():
    reps = [RepTiming(0.5, 1.0), RepTiming(0.25, 2.0)]
    s = metrics.summarize_latency(100, 10, reps)
    assert s.pp.mean == pytest.approx((200 + 400) / 2)
    assert s.pp.sd == pytest.approx(np.std([200, 400], ddof=1))
    assert s.tg.mean == pytest.approx((10 + 5) / 2)
    assert s.total.mean == pytest.approx((110 / 1.5 + 110 / 2.25) / 2)
    assert s.t_pp_s.mean == pytest.approx(0.375)
    assert set(s.as_dict()) == {"pp", "tg", "total", "t_pp_s", "t_tg_s"}


def test_plan_keeps_what_fits_and_shrinks_what_does_not():
    assert metrics.plan_within_budget(512, 128, 5, 1e-3, 1e-2, 100) == metrics.RunPlan(512, 128, 5)
    # 1.792 s per repetition, 6 runs do not fit 8 s: fewer repetitions first
    fewer = metrics.plan_within_budget(512, 128, 5, 1e-3, 1e-2, 8.0)
    assert (fewer.pp, fewer.tg, fewer.reps) == (512, 128, 3) and "reps 5 -> 3" in fewer.reason
    # stock vLLM W4A8 at ~6 tok/s: 107 s per repetition against 60 s: sizes shrink, with the reason
    slow = metrics.plan_within_budget(512, 128, 5, 1 / 6.4, 1 / 4.7, 60.0)
    assert slow.reps == 2 and slow.pp < 512 and slow.tg < 128
    assert slow.pp >= 16 and slow.tg >= 4 and "pp 512 ->" in slow.reason


def test_ratio_handles_missing_values():
    assert metrics.ratio(3.0, 2.0) == 1.5
    assert math.isnan(metrics.ratio(3.0, 0.0))
    assert math.isnan(metrics.ratio(math.nan, 1.0))


# ---- serving arithmetic ----


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        v = rng.random(n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert metrics.percentile(v, q) == pytest.approx(np.percentile(v, q))
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_request_record_ttft_tpot_itl():
    r = RequestRecord(start=10.0, end=10.9, prompt_tokens=16, output_tokens=4, chunk_times=[10.3, 10.5, 10.6, 10.9])
    assert r.ttft == pytest.approx(0.3)
    assert r.tpot == pytest.approx(0.6 / 3)
    assert r.itl == pytest.approx([0.2, 0.1, 0.3])
    assert r.latency == pytest.approx(0.9)
    one = RequestRecord(start=0.0, end=1.0, prompt_tokens=1, output_tokens=1, chunk_times=[0.5])
    assert math.isnan(one.tpot) and one.itl == []


def test_summarize_serve_counts_only_successes():
    ok1 = RequestRecord(0.0, 1.0, 100, 3, [0.2, 0.6, 1.0])
    ok2 = RequestRecord(0.5, 2.0, 100, 3, [1.0, 1.5, 2.0])
    bad = RequestRecord(0.0, 0.1, 100, 0, [], ok=False, error="HTTP 400")
    s = metrics.summarize_serve([ok1, ok2, bad], duration_s=2.0)
    assert (s.completed, s.failed, s.input_tokens, s.output_tokens) == (2, 1, 200, 6)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(3.0)
    assert s.total_throughput == pytest.approx(103.0)
    assert s.ttft.mean_ms == pytest.approx(350.0)
    assert s.ttft.p50_ms == pytest.approx(350.0)
    assert s.tpot.mean_ms == pytest.approx(450.0)  # (0.8 / 2 + 1.0 / 2) / 2
    assert s.itl.p50_ms == pytest.approx(450.0)  # gaps 0.4, 0.4, 0.5, 0.5
    assert s.itl.p99_ms == pytest.approx(500.0)


def test_efficiency_is_the_articles_normalisation():
    s = metrics.summarize_serve([RequestRecord(0.0, 1.0, 10, 2, [0.25, 1.0])], duration_s=1.0)
    e = metrics.efficiency(s, peak_tflops=148.0, peak_gbps=4000.0)
    assert e["ttft_efficiency_per_tflops"] == pytest.approx(1 / (148.0 * 0.25))
    assert e["total_throughput_per_tflops"] == pytest.approx(12 / 148.0)
    assert e["output_throughput_per_gbps"] == pytest.approx(2 / 4000.0)
    assert metrics.efficiency(s, None, None) == {}
    with pytest.raises(ValueError):
        metrics.efficiency(s, -1.0, None)


def test_scenarios_and_article_preset():
    args = SimpleNamespace(preset="article", scale=0.01, concurrency=[1], input_len=[512], output_len=[128])
    serve.apply_preset(args)
    assert args.concurrency == [64] and args.input_len == [41, 164, 328] and args.output_len == [10]
    plan = serve.scenarios([1, 4], [16, 32], [8], None)
    assert [(s.concurrency, s.input_len, s.num_prompts) for s in plan] == [(1, 16, 8), (4, 16, 8), (1, 32, 8),
                                                                           (4, 32, 8)]
    with pytest.raises(Exception, match="--concurrency"):
        serve.scenarios([0], [16], [8], None)


# ---- peers ----


def test_w8a8_copy_is_per_channel_int8(tiny_llama, tmp_path):
    from anychip.checkpoint.io import read_tensor, read_tensor_infos

    src = tiny_llama()
    dst = peers.make_w8a8(src, tmp_path / "w8a8")
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    infos = read_tensor_infos(dst)
    name = "model.layers.0.mlp.down_proj"
    w = read_tensor(read_tensor_infos(src)[f"{name}.weight"]).float()
    q, s = read_tensor(infos[f"{name}.weight"]), read_tensor(infos[f"{name}.weight_scale"])
    assert q.dtype == torch.int8 and s.shape == (w.shape[0], 1)
    assert int(q.abs().max()) == 127
    assert torch.allclose(q.float() * s, w, atol=float(s.max()) / 2 + 1e-6)
    assert peers.make_w8a8(src, dst) == dst  # cached: same source stamp


def test_int_quantized_copy_holds_the_same_weights(tiny_llama, tmp_path):
    from anychip.checkpoint.io import read_tensor, read_tensor_infos
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.formats import unpack_int4

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    out = peers.make_int_quantized(w4a8)
    assert out == w4a8.with_name("w4a8-int")
    assert ModelDir.open(out).kind == "w4a8"
    packed, unpacked = read_tensor_infos(w4a8), read_tensor_infos(out)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        q = read_tensor(unpacked[f"{name}.weight"])
        assert torch.equal(q, unpack_int4(read_tensor(packed[f"{name}.weight_packed"])))
        assert torch.equal(read_tensor(unpacked[f"{name}.weight_scale"]), read_tensor(packed[f"{name}.weight_scale"]))
    assert not any(n.endswith((".weight_packed", ".weight_shape")) for n in unpacked)


def test_plan_systems_reports_every_peer(tiny_llama, tmp_path):
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    rows = latency.plan_systems(ModelDir.open(w4a8), with_peers=True)
    assert [r.name for r in rows] == [s for s in latency.SYSTEMS
                                      if not s.startswith("vllm-w4a16") and s != latency.FLOOR]
    assert rows[0].plugin and rows[1].plugin and not any(r.plugin for r in rows[2:])
    assert rows[1].env == {"ANYCHIP_HEAD": "int8"}  # the same model served with --head int8
    gguf = rows[-1]
    assert gguf.skipped and any(why in gguf.skipped for why in ("different model", "not installed", "not import"))
    synthetic = dict(ModelDir.open(w4a8).config)
    synthetic["quantization_config"] = dict(synthetic["quantization_config"],
                                            anychip={"source": "synthetic", "method": "random"})
    rows = latency.plan_systems(ModelDir(w4a8, synthetic), with_peers=True)
    by = {r.name: r for r in rows}
    assert "random weights" in by["vllm-bf16"].skipped and "BF16 source" in by["vllm-w8a8"].skipped
    assert by["anychip-w4a8"].notes and by["vllm-w4a8-stock"].skipped is None
    assert [r.name for r in latency.plan_systems(ModelDir(w4a8, synthetic), with_peers=False)] == ["anychip-w4a8"]


def test_gpu_peers_are_bf16_of_the_same_weights_and_stock_routes(tiny_llama, tmp_path):
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.io import read_tensor, read_tensor_infos
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.formats import unpack_int4

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    synthetic = dict(ModelDir.open(w4a8).config)
    synthetic["quantization_config"] = dict(synthetic["quantization_config"],
                                            anychip={"source": "synthetic", "method": "random"})
    rows = latency.plan_systems(ModelDir(w4a8, synthetic), with_peers=True, device="cuda")
    assert [r.name for r in rows] == ["anychip-w4a8", "vllm-bf16", *latency.GPU_STOCK]
    assert not any(r.skipped for r in rows) and not any(r.plugin for r in rows[1:])
    assert rows[-1].env == {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}
    assert "dequantized" in rows[1].weights
    bf16 = rows[1].build()  # no BF16 source: the W4A8 weights dequantized
    assert ModelDir.open(bf16).kind == "bf16"
    packed, dense = read_tensor_infos(w4a8), read_tensor_infos(bf16)
    name = "model.layers.1.mlp.down_proj"
    q = unpack_int4(read_tensor(packed[f"{name}.weight_packed"]))
    scale = read_tensor(packed[f"{name}.weight_scale"]).float().repeat_interleave(32, dim=1)
    assert torch.equal(read_tensor(dense[f"{name}.weight"]), (q.float() * scale).to(torch.bfloat16))
    assert not any(n.endswith(("_packed", "_scale", "_shape")) for n in dense)
    assert rows[2].build() == w4a8  # stock vLLM on the very checkpoint
    w4a16 = rows[3].build()
    qc = ModelDir.open(w4a16).quantization_config
    assert all(g["input_activations"] is None for g in qc["config_groups"].values())
    assert read_tensor_infos(w4a16).keys() == packed.keys()
    assert rows[4].build() == w4a16  # Marlin: the same cached copy


def test_gpu_targets_batch_and_stock_kernels(tmp_path):
    rows = [_latency_row("anychip-w4a8", 20000, 400), _latency_row("vllm-bf16", 30000, 360),
            _latency_row("vllm-w4a16-marlin", 25000, 430)]
    for r, tps in zip(rows, (7000.0, 9500.0, 6900.0)):
        r.update(batch=64, batch_pp=512, batch_tg=128, batch_tps=metrics.mean_sd([tps, tps]))
    checks = {(t["metric"], t["peer"]): t for t in latency.target_checks(rows, "cuda")}
    assert checks[("batch64", "vllm-bf16")]["ratio"] == pytest.approx(7000 / 9500)
    assert checks[("tg128", "vllm-w4a16-marlin")]["met"] is False and checks[("tg128", "vllm-bf16")]["met"] is False
    assert ("pp512", "vllm-w8a8") not in checks  # a CPU target
    rows[0]["engine_start_s"], rows[1]["engine_start_s"] = 70.0, 60.0  # engine start: a maximum, lower is better
    start = latency.target_checks(rows, "cuda")
    start = next(t for t in start if t["metric"] == "start")
    assert start["ratio"] == pytest.approx(70 / 60) and start["met"] is True and start["at_most"] is True
    rows[0]["engine_start_s"] = 80.0
    assert next(t for t in latency.target_checks(rows, "cuda") if t["metric"] == "start")["met"] is False
    assert "≤ 1.25x" in latency.render_markdown({"commands": [], "created": "now", "machine": {"cpu": "x", "cpus": 1},
                                                "threads": 1, "requested": {"pp": 512, "tg": 128, "reps": 2},
                                                "rows": rows, "targets": latency.target_checks(rows, "cuda")})
    rows[2]["vllm_kernels"] = ["MarlinLinearKernel for CompressedTensorsWNA16"]
    doc = {"commands": ["c"], "created": "now", "machine": {"cpu": "x", "cpus": 16, "gpu": "NVIDIA H200"},
           "threads": 16, "requested": {"pp": 512, "tg": 128, "reps": 2}, "rows": rows,
           "targets": latency.target_checks(rows, "cuda")}
    md = latency.render_markdown(doc)
    assert "batch 64 (512 in, 128 out) output tok/s" in md and "NVIDIA H200" in md
    assert "vLLM chose MarlinLinearKernel for CompressedTensorsWNA16" in md
    log = tmp_path / "x.log"
    log.write_text("INFO [x.py:1] Using CutlassW4A8LinearKernel for CompressedTensorsW4A8Fp8\n" * 3)
    assert latency.chosen_kernels(log) == ["CutlassW4A8LinearKernel for CompressedTensorsW4A8Fp8"]


def test_engine_start_breakdown_from_the_log(tmp_path):
    """vLLM 0.26's and 0.32's start lines and anychip's precompile lines (parallel: the longest counts)."""
    log = tmp_path / "e.log"
    log.write_text(
        "(EngineCore pid=1) INFO 12-02 [default_loader.py:501] Loading weights took 3.15 seconds\n"
        "INFO [gpu_model_runner.py:1] Model loading took 2.4200 GiB memory and 4.501 seconds\n"
        "anychip: precompiled 9 Triton kernels for N=6144 K=2048 G128 in 12.5 s (8 threads)\n"
        "anychip: precompiled 7 Triton kernels for N=2048 K=6144 G128 in 17.0 s (8 threads)\n"
        "INFO [backends.py:1] Compiling a graph for compile range (1, 8192) takes 7.04 s\n"
        "INFO [monitor.py:1] torch.compile takes 9.42 s in total\n"
        "INFO [gpu_model_runner.py:2] Graph capturing finished in 2 secs, took 0.10 GiB\n"
        "INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 22.26 seconds\n")
    assert latency.start_breakdown(log) == {
        "load_weights_s": 3.15, "model_loading_s": 4.5, "torch_compile_s": 9.42, "graph_capture_s": 2.0,
        "init_engine_s": 22.26, "triton_precompile_s": 17.0}
    assert latency.start_breakdown(tmp_path / "missing.log") == {}
    row = _latency_row("anychip-w4a8", 20000, 400)
    row.update(engine_start_s=61.0, start_breakdown={"torch_compile_s": 9.42, "graph_capture_s": 2.0})
    notes = latency.render_markdown({"commands": [], "created": "now", "machine": {"cpu": "x", "cpus": 1},
                                     "threads": 1, "requested": {"pp": 8, "tg": 4, "reps": 1}, "rows": [row],
                                     "targets": []})
    assert "anychip-w4a8: engine start 61.0 s, as its log states it: torch compile 9.4 s, graph capture 2.0 s" in notes
    row.update(gpu_sm_clock_mhz=[[1980.0, 1755.0], [None, 1980.0]],
               coverage={"linears": 4, "routes": {"cuda.triton": 4}, "fused": {"rms_norm": 2}})
    notes = latency.render_markdown({"commands": [], "created": "now", "machine": {"cpu": "x", "cpus": 1},
                                     "threads": 1, "requested": {"pp": 8, "tg": 4, "reps": 1}, "rows": [row],
                                     "targets": []})
    assert "prefill / decode): 1980/1755, ?/1980" in notes
    assert "4 quantized linears (cuda.triton: 4); rms_norm computed inside the kernels of 2" in notes


def test_stock_systems_leave_the_plugin_out(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    stock = latency.system_env(latency.System("vllm-bf16", "vllm", "BF16"), 2, None)
    assert "anychip" not in stock["VLLM_PLUGINS"].split(",")
    assert stock["OMP_NUM_THREADS"] == "2" and stock["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    ours = latency.system_env(latency.System("anychip-w4a8", "vllm", "W4A8", plugin=True), 2, Path("/tmp/c.json"))
    assert "VLLM_PLUGINS" not in ours and ours["ANYCHIP_COVERAGE"] == "/tmp/c.json"
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert latency.system_env(latency.System("anychip-w4a8", "vllm", "W4A8", plugin=True), 2, None)[
        "VLLM_PLUGINS"] == "other,anychip"


def test_a_users_engine_settings_win(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    for system in (latency.System("vllm-bf16", "vllm", "BF16"),
                   latency.System("anychip-w4a8", "vllm", "W4A8", plugin=True)):
        assert latency.system_env(system, 2, None)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_each_engine_compiles_into_empty_caches_of_its_own(monkeypatch, tmp_path):
    """--compile-cache cold (the default): every vLLM system gets its own compile-cache folders, so that no engine
    starts on kernels another system compiled; a cache variable the user set is kept; llama.cpp gets none."""
    for name in envs.COMPILE_CACHES:
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(compile_cache="cold")
    systems = [latency.System("anychip-w4a8", "vllm", "W4A8", plugin=True),
               latency.System("vllm-bf16", "vllm", "BF16")]
    envs_of = [latency.system_env(s, 2, None, latency._cold_caches(args, tmp_path, s)) for s in systems]
    for env in envs_of:
        assert set(envs.COMPILE_CACHES) <= set(env)
        assert all(env[n].startswith(str(tmp_path)) for n in envs.COMPILE_CACHES)
    assert not set(envs_of[0][n] for n in envs.COMPILE_CACHES) & set(envs_of[1][n] for n in envs.COMPILE_CACHES)
    (tmp_path / "vllm-bf16.caches" / "left-over").mkdir(parents=True)
    assert not (latency._cold_caches(args, tmp_path, systems[1]) / "left-over").exists()  # a retry starts empty too
    llama = latency.System("llama.cpp-q4_0", "llama.cpp", "Q4_0")
    llama_env = latency.system_env(llama, 2, None, latency._cold_caches(args, tmp_path, llama))
    assert not set(envs.COMPILE_CACHES) & set(llama_env)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    kept = latency.system_env(systems[0], 2, None, latency._cold_caches(args, tmp_path, systems[0]))
    assert "TRITON_CACHE_DIR" not in kept and "TORCHINDUCTOR_CACHE_DIR" in kept  # the user's own variable wins
    shared = argparse.Namespace(compile_cache="shared")
    assert latency._cold_caches(shared, tmp_path, systems[0]) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in latency.system_env(systems[0], 2, None, None)


# ---- reports ----


def _latency_row(system: str, pp_tps: float, tg_tps: float, pp: int = 512) -> dict:
    s = metrics.summarize_latency(pp, 128, [RepTiming(pp / pp_tps, 128 / tg_tps)] * 2)
    return {"system": system, "engine": "vllm", "weights": "w", "status": "ok", "requested":
            {"pp": 512, "tg": 128, "reps": 2}, "notes": [], "pp": pp, "tg": 128, "reps": 2, "reduced": None,
            "pp_tps": s.pp, "tg_tps": s.tg, "total_tps": s.total, "engine_start_s": 30.0,
            "settings": {"compile_mode": "eager", "executor": "uni", "dtype": "bfloat16", "torch_threads": 2,
                         "max_num_batched_tokens": 528, "versions": {}}}


def test_latency_report_targets_and_files(tmp_path):
    rows = [_latency_row("anychip-w4a8", 2000, 100), _latency_row("vllm-bf16", 1000, 60),
            _latency_row("vllm-w8a8", 2100, 70), _latency_row("llama.cpp-q4_1", 300, 90, pp=256),
            {"system": "vllm-w4a8-stock", "engine": "vllm", "weights": "w", "status": "skipped",
             "reason": "needs a W4A8 model", "requested": {"pp": 512, "tg": 128, "reps": 2}, "notes": []}]
    checks = {(t["metric"], t["peer"]): t for t in latency.target_checks(rows)}
    assert checks[("tg128", "llama.cpp-q4_1")]["ratio"] == pytest.approx(100 / 90)
    assert checks[("tg128", "vllm-w8a8")]["met"] is False
    assert checks[("pp512", "vllm-bf16")]["met"] is True
    assert checks[("pp512", "llama.cpp-q4_1")]["same_size"] is False
    doc = {"commands": ["anychip bench latency M --peers"], "created": "now", "machine": {"cpu": "cpu", "cpus": 2},
           "threads": 2, "requested": {"pp": 512, "tg": 128, "reps": 2}, "rows": rows,
           "targets": latency.target_checks(rows)}
    md = latency.render_markdown(doc)
    assert "`anychip bench latency M --peers`" in md and "vllm-w4a8-stock: skipped: needs a W4A8 model" in md
    assert "CUDA graphs" not in md
    rows[0]["settings"]["cuda_graph_max_tokens"] = 2  # a batch-one GPU engine: a pp512 prefill runs eagerly
    assert "CUDA graphs replay steps of up to 2 tokens" in latency.render_markdown(doc)
    del rows[0]["settings"]["cuda_graph_max_tokens"]
    assert "(pp256*)" in md and "sizes differ" in md
    from anychip.bench.report import write_outputs

    written = write_outputs(tmp_path / "lat.json", doc, md, latency.plot)
    assert [p.suffix for p in written] == [".json", ".md", ".png"]
    back = json.loads((tmp_path / "lat.json").read_text())
    assert back["rows"][0]["pp_tps"]["mean"] == pytest.approx(2000)

    # --append: a re-measured system replaces its row, the others stay; a different setup is refused
    doc.update(model="M", threads=2)
    write_outputs(tmp_path / "lat.json", doc, md)
    again = dict(doc, rows=[_latency_row("vllm-bf16", 1200, 61)])
    merged = latency.merge_into(tmp_path / "lat.json", again)
    assert [r["system"] for r in merged["rows"]] == ["anychip-w4a8", "vllm-bf16", "vllm-w8a8", "vllm-w4a8-stock",
                                                     "llama.cpp-q4_1"]
    assert merged["rows"][1]["pp_tps"].mean == pytest.approx(1200)
    assert merged["rows"][0]["pp_tps"].mean == pytest.approx(2000)
    with pytest.raises(Exception, match="threads=2"):
        latency.merge_into(tmp_path / "lat.json", dict(again, threads=1))


def test_a_crash_mid_run_keeps_the_rows_measured_before_it(tiny_llama, tmp_path, monkeypatch):
    """The report is rewritten after every system, so a later crash loses no measured row; a peer whose
    checkpoint cannot be built (its own tooling raising anything) is a failed row, not the end of the bench."""
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    broken = latency.System("vllm-w8a8", "vllm", "W8A8", build=lambda: (_ for _ in ()).throw(OSError("disk full")))
    row = latency.run_system(broken, argparse.Namespace(pp=8, tg=4, reps=1, wait_idle=0), tmp_path)
    assert row["status"] == "failed" and "OSError: disk full" in row["error"]
    # a peer the model cannot have (found when its checkpoint is made: a Gemma model has no GGUF conversion here)
    # is a skipped row that says why, as the peers left out when the plan is made
    unconvertible = latency.System("llama.cpp-q4_0", "llama.cpp", "Q4_0", build=lambda: (_ for _ in ()).throw(
        peers.PeerUnavailable("bf16 is gemma3_text: no GGUF conversion here")))
    row = latency.run_system(unconvertible, argparse.Namespace(pp=8, tg=4, reps=1, wait_idle=0), tmp_path)
    assert row["status"] == "skipped" and "gemma3_text" in row["reason"]

    systems = [latency.System("vllm-bf16", "vllm", "BF16"), latency.System("vllm-w8a8", "vllm", "W8A8")]
    monkeypatch.setattr(latency, "plan_systems", lambda md, peers, device: systems)

    def run_system(system, args, workdir):
        if system.name == "vllm-w8a8":
            raise KeyboardInterrupt  # the user stops the bench, or anything else ends it, after the first system
        return _latency_row(system.name, 1000, 60)

    monkeypatch.setattr(latency, "run_system", run_system)
    monkeypatch.setattr(latency, "warm_python", lambda packages, device: {"packages": list(packages),
                                                                          "device": device, "seconds": 1.5})
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", str(w4a8), "--peers", "--device", "cpu", "--pp", "128", "--tg", "32",
                 "--json", str(out)]) == 130
    doc = json.loads(out.read_text())
    assert [r["system"] for r in doc["rows"]] == ["vllm-bf16"]
    assert doc["not_run"] == ["vllm-w8a8"]  # the stopped report says what it lacks
    assert doc["warm_python"] == {"packages": ["vllm", "anychip"], "device": "cpu", "seconds": 1.5}
    md = out.with_suffix(".md").read_text()
    assert "**Incomplete**: not measured yet when this report was written" in md and "stopped): vllm-w8a8." in md
    assert "vllm-bf16" in md and "one throwaway process byte-compiled and imported vllm, anychip (1.5 s" in md


def test_warm_python_compiles_and_imports_in_a_throwaway_process(tmp_path, monkeypatch):
    """bench latency's warm-up child: every module of the package byte-compiled (no .pyc before), the package
    imported; a package that does not import is reported, not raised."""
    from anychip.bench.host import warm_python

    pkg = tmp_path / "warmpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import used\n")
    (pkg / "used.py").write_text("X = 1\n")
    (pkg / "unused.py").write_text("Y = 2\n")  # never imported: compiled all the same
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    done = warm_python(("warmpkg",))
    assert "error" not in done and done["seconds"] >= 0 and done["packages"] == ["warmpkg"]
    assert {p.name.split(".")[0] for p in (pkg / "__pycache__").glob("*.pyc")} == {"__init__", "used", "unused"}
    failed = warm_python(("warmpkg", "no_such_package_here"))
    assert "No module named 'no_such_package_here'" in failed["error"]


def test_a_llama_cpp_that_does_not_import_is_an_unavailable_peer(tmp_path, monkeypatch):
    """llama-cpp-python installed without its dependencies (`--no-deps`: no diskcache) is found by find_spec but
    fails to import: the peer is unavailable with that reason, where it used to crash the whole bench."""
    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text("import diskcache_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    peers._llama_cpp_import_error.cache_clear()
    try:
        with pytest.raises(peers.PeerUnavailable, match="does not import.*diskcache_that_is_not_installed"):
            peers.llama_cpp_available()
    finally:
        peers._llama_cpp_import_error.cache_clear()
        monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)


# ---- the streaming client against a scripted server ----


class _ScriptedSSE(BaseHTTPRequestHandler):
    """An OpenAI completions endpoint that streams max_tokens chunks 10 ms apart, then usage."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "scripted"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if len(req["prompt"]) > 64:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "prompt too long"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(req["max_tokens"]):
            time.sleep(0.01)
            self.wfile.write(b'data: {"choices": [{"text": "x", "index": 0}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(req["prompt"]), "completion_tokens": req["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def scripted_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedSSE)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_bench_serve_against_a_scripted_server(scripted_server, tmp_path):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", scripted_server, "--concurrency", "1,2", "--input-len", "16", "--output-len", "5",
               "--num-prompts", "3", "--label", "a", "--json", str(out)])
    assert rc == 0
    rc = main(["bench", "serve", scripted_server, "--concurrency", "1,2", "--input-len", "16", "--output-len", "5",
               "--num-prompts", "3", "--label", "b", "--append", "--baseline", "b", "--peak-tflops", "1",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert sorted({r["label"] for r in doc["rows"]}) == ["a", "b"] and len(doc["commands"]) == 2
    for r in doc["rows"]:
        assert (r["completed"], r["failed"], r["output_tokens"], r["input_tokens"]) == (3, 0, 15, 48)
        assert r["ttft"]["mean_ms"] > 0 and r["tpot"]["mean_ms"] > 0 and r["itl"]["p99_ms"] >= r["itl"]["p50_ms"]
    assert {c["label"] for c in doc["comparisons"]} == {"a"} and len(doc["comparisons"]) == 2
    md = out.with_suffix(".md").read_text()
    assert "--label a" in md and "--label b" in md and "Against b" in md
    assert out.with_suffix(".png").exists()
    assert serve.comparisons(doc["rows"], "B") == []  # a mistyped baseline: no ratios against another label


def test_a_serve_report_written_between_levels_names_the_levels_not_run(scripted_server, tmp_path, monkeypatch):
    """The report is rewritten after every level; one written before the last level (the run then stopped, here by
    Ctrl-C during the second level) says which levels it lacks, in the JSON and the table's page."""
    real = serve.run_level
    calls = []

    async def stop_at_the_second(*a, **k):
        calls.append(a[2] if len(a) > 2 else None)
        if len(calls) == 3:  # the first request is the server's warm-up, then level 1, then level 2
            raise KeyboardInterrupt
        return await real(*a, **k)

    monkeypatch.setattr(serve, "run_level", stop_at_the_second)
    out = tmp_path / "s.json"
    assert main(["bench", "serve", scripted_server, "--concurrency", "1,2", "--input-len", "8", "--output-len", "3",
                 "--num-prompts", "2", "--json", str(out)]) == 130
    doc = json.loads(out.read_text())
    assert [r["concurrency"] for r in doc["rows"]] == [1] and doc["not_run"] == ["c=2 in=8 out=3"]
    assert "**Incomplete**: levels not measured yet" in out.with_suffix(".md").read_text()
    monkeypatch.setattr(serve, "run_level", real)
    assert main(["bench", "serve", scripted_server, "--concurrency", "1,2", "--input-len", "8", "--output-len", "3",
                 "--num-prompts", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "not_run" not in doc and len(doc["rows"]) == 2
    assert "Incomplete" not in out.with_suffix(".md").read_text()


def test_bench_serve_reports_the_api_process_cpu_share(scripted_server, tmp_path):
    """A launched server's URL carries its API process's pid; each level then records that process's CPU share,
    the sign that vLLM's frontend (one core), not the engine, set the pace. Here the scripted server runs in this
    process, so the share is this process's, client included; a URL without a pid records none."""
    from anychip.bench.server import ServerURL, process_cpu_s

    t0 = process_cpu_s(os.getpid())
    deadline = time.process_time() + 0.1  # /proc counts in clock ticks (10 ms): leave them room
    while time.process_time() < deadline:
        pass
    assert process_cpu_s(os.getpid()) >= t0 + 0.05 and process_cpu_s(None) is None
    assert process_cpu_s(2**22 + 12345) is None  # above the kernel's pid limit: no such process
    url = ServerURL(scripted_server)
    url.pid = os.getpid()
    args = build_parser().parse_args(["bench", "serve", scripted_server, "--concurrency", "2", "--input-len", "16",
                                      "--output-len", "5", "--num-prompts", "4"])
    (row,) = serve.measure_server(url, args)
    assert 0 < row["api_process_cpu_share"] < 2
    md = serve.render_markdown({"commands": [], "created": "now", "machine": {"cpu": "x", "cpus": 1}, "rows": [row],
                                "comparisons": []})
    assert "CPU share of the launched server's API process" in md
    (plain,) = serve.measure_server(scripted_server, args)
    assert "api_process_cpu_share" not in plain


def test_serve_report_prints_efficiency_to_four_significant_digits():
    """TTFT efficiency on a GPU is about 1e-4 (1 / (989 TFLOPS x 11.7 s)): the table once printed it as 0.0001."""
    dist = {"mean_ms": 11662.4, "p50_ms": 10983.1, "p99_ms": 24014.4}
    row = {"label": "vllm-bf16", "concurrency": 64, "input_len": 32768, "output_len": 1024, "completed": 64,
           "failed": 0, "request_throughput": 1.43, "output_throughput": 1465.5, "total_throughput": 48360.8,
           "ttft": dist, "tpot": {"mean_ms": 29.5}, "itl": dist, "errors": [], "efficiency": {
               "ttft_efficiency_per_tflops": 1 / (989 * 11.6624), "total_throughput_per_tflops": 48360.8 / 989}}
    md = serve.render_markdown({"commands": [], "created": "now", "machine": {"cpu": "x", "cpus": 1}, "rows": [row],
                                "comparisons": []})
    line = next(x for x in md.splitlines() if x.startswith("| vllm-bf16 | 64 | 32768 | 1024 | 48.9"))
    assert "| 8.67e-05 |" in line, line


def test_serve_report_names_each_launched_servers_graph_sizes():
    """A launched server's command is recorded; the CUDA graph sizes serve's profile gave it are named in the notes,
    so that two servers can be seen to have had the same graphs."""
    from anychip import cuda_graphs

    sizes = cuda_graphs.capture_sizes(4096)
    flags = ["--model", "/m", "--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]
    assert serve.graph_sizes(flags) == sizes
    assert serve.graph_sizes(["--compilation-config", '{"splitting_ops": []}']) is None
    assert serve.graph_sizes(["--compilation-config", "not json"]) is None and serve.graph_sizes([]) is None
    dist = {"mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 1.0}
    row = {"label": "anychip-w4a8", "concurrency": 1, "input_len": 8, "output_len": 2, "completed": 1, "failed": 0,
           "request_throughput": 1.0, "output_throughput": 2.0, "total_throughput": 10.0, "ttft": dist,
           "tpot": {"mean_ms": 1.0}, "itl": dist, "errors": [], "efficiency": {},
           "server": {"model": "/m", "plugin": True, "extra_args": [], "start_s": 1.0, "tokenizer_gap": None,
                      "command": flags, "cuda_graph_sizes": sizes}}
    md = serve.render_markdown({"commands": [], "created": "now", "machine": {"cpu": "x", "cpus": 1}, "rows": [row],
                                "comparisons": []})
    assert f"CUDA graphs captured for {len(sizes)} step sizes up to 4096 tokens" in md


def test_bench_serve_counts_failed_requests(scripted_server, tmp_path):
    rc = main(["bench", "serve", scripted_server, "--concurrency", "1", "--input-len", "100", "--output-len", "2",
               "--num-prompts", "2", "--json", str(tmp_path / "s.json")])
    assert rc == 1
    row = json.loads((tmp_path / "s.json").read_text())["rows"][0]
    assert row["failed"] == 2 and "HTTP 400" in row["errors"][0]


def test_bench_serve_keeps_the_levels_it_finished(scripted_server, tmp_path, monkeypatch):
    """The report is written after every level: a later level that dies leaves the earlier ones on disk."""
    real, calls = serve.run_level, []

    def flaky(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 3:  # the warm-up request, the first level, then the second level
            raise RuntimeError("the second level died")
        return real(*args, **kwargs)

    monkeypatch.setattr(serve, "run_level", flaky)
    out = tmp_path / "serve.json"
    with pytest.raises(RuntimeError, match="second level"):
        main(["bench", "serve", scripted_server, "--concurrency", "1,2", "--input-len", "16", "--output-len", "3",
              "--num-prompts", "2", "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["concurrency"], row["completed"]) == (1, 2)
    assert "| 1 | 16 | 3 |" in out.with_suffix(".md").read_text()


_FAKE_SERVER = """
import http.server, os, sys
open(sys.argv[2], "w").write(str(os.getpid()))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": [{"id": "m"}]}')
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

_HOLDER = """
import sys, time
from pathlib import Path
from anychip.bench import server
server.server_command = lambda model, host, port, extra: ([sys.executable, "-c", sys.argv[1], str(port), sys.argv[2]], {})
with server.local_server(Path("."), ready_timeout_s=60):
    print("ready", flush=True)
    time.sleep(120)
"""


def test_a_terminated_bench_stops_its_server(tmp_path):
    """`timeout` sends SIGTERM: the launched server (its own process group) must not outlive the bench, or it keeps
    the port and the GPU's memory from the next server."""
    import os
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "server.pid"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, _FAKE_SERVER, str(pid_file)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        pid = int(pid_file.read_text())
        os.kill(pid, 0)  # the server runs
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=90) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        holder.kill()


# ---- one short real run of each (slow) ----


@pytest.mark.slow
def test_bench_latency_real_run(default_model, tmp_path):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", str(default_model.bf16_dir), "--pp", "32", "--tg", "8", "--reps", "1",
               "--eager", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["system"] == "vllm-bf16" and row["status"] == "ok", row
    assert (row["pp"], row["tg"], row["reps"]) == (32, 8, 1) and len(row["timings"]) == 1
    assert row["pp_tps"]["mean"] > 0 and row["tg_tps"]["mean"] > 0 and row["engine_start_s"] > 0
    assert row["settings"]["compile_mode"] == "eager" and "anychip" not in row["settings"]["env"]["VLLM_PLUGINS"]
    assert row["settings"]["cuda_graph_max_tokens"] == 0  # an eager CPU engine replays no CUDA graph
    assert "error" not in doc["warm_python"], doc["warm_python"]  # vLLM and anychip imported before the engine
    assert out.with_suffix(".md").exists()


@pytest.mark.slow
def test_bench_serve_real_server(default_model, tmp_path):
    from anychip.bench.server import local_server

    out = tmp_path / "serve.json"
    with local_server(default_model.w4a8_dir, extra=["--enforce-eager"], log=tmp_path / "server.log") as url:
        assert url.startswith("http://127.0.0.1:")
        rc = main(["bench", "serve", url, "--concurrency", "1,2", "--input-len", "16", "--output-len", "4",
                   "--num-prompts", "2", "--label", "anychip", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["completed"] == 2 and r["output_tokens"] == 8 for r in rows)


def test_bench_serve_wants_a_url_or_launch():
    assert main(["bench", "serve"]) == 2
    assert main(["bench", "serve", "http://127.0.0.1:1/v1", "--launch", "somewhere"]) == 2
    assert main(["bench", "serve", "http://127.0.0.1:1/v1", "--stock"]) == 2


def test_source_commit_can_be_named_for_an_exported_tree(monkeypatch) -> None:
    """A `git archive` export has no .git: ANYCHIP_SOURCE_COMMIT names the commit the report records."""
    from anychip.bench.host import source_state

    monkeypatch.setenv("ANYCHIP_SOURCE_COMMIT", "5ddecec")
    assert source_state() == {"commit": "5ddecec", "uncommitted": []}


@pytest.mark.parametrize("tied", [True, False])
def test_decode_bytes_and_the_bandwidth_bound_target(tmp_path, tied: bool) -> None:
    """A decode step reads every tensor but the embedding of an untied model (one row of it); a tied head streams
    the embedding. tg128 against read bandwidth / those bytes is the CPU report's bandwidth target."""
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),  # 1600 B
               "model.layers.0.mlp.down_proj.weight_packed": torch.zeros(8, 2, dtype=torch.int32),  # 64 B
               "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}  # 16 B
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(100, 8, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    assert latency.decode_bytes(ModelDir.open(tmp_path)) == 1680

    row = {"system": latency.OURS, "status": "ok", "tg": 128, "tg_tps": MeanSd(30.0, 1.0, 3)}
    row["bandwidth"] = latency.bandwidth_bound(row, 40.0, 10**9)  # 40 tok/s at best
    assert row["bandwidth"]["bound_tps"] == 40.0 and row["bandwidth"]["tg_of_bound"] == 0.75
    (check,) = latency.target_checks([row], "cpu")
    assert check["metric"] == "tg128 of bound" and check["met"] and check["target"] == latency.BOUND_TARGET
    row["tg_tps"] = MeanSd(20.0, 1.0, 3)
    row["bandwidth"] = latency.bandwidth_bound(row, 40.0, 10**9)
    assert not latency.target_checks([row], "cpu")[0]["met"]
    assert latency.target_checks([row], "cuda") == []  # a GPU report has no such target


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux: VmHWM")
def test_a_runners_peak_memory_is_its_own(tmp_path):
    """A runner started by a process that grew larger reports its own peak, not the parent's (ru_maxrss, which
    Linux carries across fork and exec, did)."""
    import subprocess
    import sys

    script = ("import subprocess, sys\n"
              "block = bytearray(1024 * 2**20)\n"
              "for i in range(0, len(block), 4096): block[i] = 1\n"
              "out = subprocess.run([sys.executable, '-c', 'from anychip.bench.runners import peak_rss_mib; "
              "print(peak_rss_mib())'], capture_output=True, text=True, check=True).stdout\n"
              "print(out.strip())\n")
    child = float(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).parent.parent).stdout.split()[-1])
    assert 0 < child < 700, child  # the child imports anychip.bench.runners (about 0.2 GiB); its parent held 1 GiB


def test_a_runner_killed_by_a_signal_is_named():
    assert peers.exit_reason(3, "vllm") == "exited with 3"
    assert peers.exit_reason(-11, "vllm") == "was killed by SIGSEGV"
    assert "AMX" in peers.exit_reason(-11, "llama.cpp") and "SIGSEGV" in peers.exit_reason(-11, "llama.cpp")
    assert peers.exit_reason(-9, "llama.cpp") == "was killed by SIGKILL"


def test_gpu_clock_sampler_keeps_readings_by_time_and_skips_non_numbers() -> None:
    """The sampler behind `gpu_sm_clock_mhz`, with a stand-in for nvidia-smi's loop (none on this machine)."""
    import sys
    import time

    from anychip.bench.gpu_clocks import ClockSampler

    script = "import time\nfor v in ('[N/A]', 1980, 1980, 1410, 1980):\n    print(v, flush=True)\n    time.sleep(0.05)"
    with ClockSampler([sys.executable, "-c", script]) as sampler:
        t0 = time.monotonic()
        deadline = t0 + 10
        while len(sampler.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [mhz for _, mhz in sampler.samples] == [1980.0, 1980.0, 1410.0, 1980.0]
    stamps = [t for t, _ in sampler.samples]
    assert stamps == sorted(stamps)
    assert sampler.median_between(stamps[0], stamps[-1]) == 1980.0
    assert sampler.median_between(stamps[2], stamps[2]) == 1410.0
    assert sampler.median_between(stamps[-1] + 1, stamps[-1] + 2) is None
    assert ClockSampler.for_device("cpu") is None
    with ClockSampler(["/no/such/nvidia-smi"]) as missing:  # a command that cannot start: no readings, no error
        pass
    assert missing.samples == []


def test_graph_tokens_is_a_gpu_engine_setting():
    """--graph-tokens sizes every GPU engine's CUDA-graph captures alike; on a CPU (or as 0) it is an error, not a
    setting silently dropped."""
    from anychip.bench.runners import RunSpec

    spec = RunSpec("anychip-w4a8", "vllm", "m", 512, 128, 5, 1, device="cuda", graph_tokens=512)
    assert spec.graph_tokens == 512
    for device, tokens in (("cpu", 512), ("cuda", 0)):
        with pytest.raises(ValueError, match="--graph-tokens"):
            RunSpec("anychip-w4a8", "vllm", "m", 512, 128, 5, 1, device=device, graph_tokens=tokens)


def test_round_by_round_ratios_pair_the_repetitions_of_one_interleaved_run(tmp_path):
    """The targets of an --interleave run carry ours ÷ peer for each round (repetition k of both rows); rows of
    other runs, and the engine start, get none; the report shows min / median / max."""
    ours, peer = _latency_row("anychip-w4a8", 2000, 100), _latency_row("llama.cpp-q4_0", 500, 80)
    ours["timings"] = [[512 / 2000, 128 / 100], [512 / 1800, 128 / 120]]
    peer["timings"] = [[512 / 500, 128 / 80], [512 / 600, 128 / 80]]
    assert latency.round_ratios(ours, peer, "tg") is None  # not interleaved
    ours["interleaved_run"] = peer["interleaved_run"] = "run-1"
    assert latency.round_ratios(ours, peer, "tg") == [1.25, 1.5]
    assert latency.round_ratios(ours, peer, "pp") == [4.0, 3.0]
    assert latency.round_ratios(ours, peer, "start") is None
    assert latency.round_ratios(ours, dict(peer, interleaved_run="run-2"), "tg") is None
    checks = {(t["metric"], t["peer"]): t for t in latency.target_checks([ours, peer])}
    assert checks[("tg128", "llama.cpp-q4_0")]["round_ratios"] == [1.25, 1.5]
    doc = {"commands": ["c"], "created": "now", "machine": {"cpu": "cpu", "cpus": 2}, "threads": 2,
           "requested": {"pp": 512, "tg": 128, "reps": 2}, "rows": [ours, peer],
           "targets": latency.target_checks([ours, peer])}
    md = latency.render_markdown(doc)
    assert "| 1.25 / 1.38 / 1.50x (2 rounds) |" in md and "interleaved (anychip-w4a8, llama.cpp-q4_0)" in md


def test_a_rows_coverage_note_names_the_linears_routes_and_the_heads(tmp_path):
    cov = tmp_path / "cov.json"
    cov.write_text(json.dumps({"layers": {"a": {"route": "cpu.amx_int8", "fused": ["rms_norm"]},
                                          "b": {"route": "cpu.amx_int8"}},
                               "head_route": {"layer": "lm_head", "route": "cpu.head_int8.avx512_vnni"}}))
    summary = latency._coverage_summary(cov)
    assert summary["routes"] == {"cpu.amx_int8": 2} and summary["head_route"] == "cpu.head_int8.avx512_vnni"
    row = dict(_latency_row("anychip-w4a8", 2000, 100), coverage=summary)
    doc = {"commands": ["c"], "created": "now", "machine": {"cpu": "cpu", "cpus": 2}, "threads": 2,
           "requested": {"pp": 512, "tg": 128, "reps": 2}, "rows": [row], "targets": []}
    assert ("coverage: 2 quantized linears (cpu.amx_int8: 2); rms_norm computed inside the kernels of 1; output head "
            "on cpu.head_int8.avx512_vnni") in latency.render_markdown(doc)


# ---- --floor: the model cut to its first decoder layer ----


def test_first_layer_copy_keeps_layer_zero_and_everything_around_it(tiny_llama, tmp_path):
    """The copy has layer 0's tensors bit for bit, the embedding, final norm and head, one layer in config.json
    (and in its per-layer lists), a manifest that verifies; it is cached."""
    from anychip.checkpoint.io import read_tensor, read_tensor_infos
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme
    from anychip.checkpoint.verify import verify_checkpoint

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    config = json.loads((w4a8 / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert layers >= 2
    config["layer_types"] = ["sliding_attention", "full_attention"] * layers
    (w4a8 / "config.json").write_text(json.dumps(config))
    one = peers.make_first_layer(w4a8)
    assert one == w4a8.with_name("w4a8-1-layer")
    got = json.loads((one / "config.json").read_text())
    assert got["num_hidden_layers"] == 1 and got["layer_types"] == ["sliding_attention"]
    src, dst = read_tensor_infos(w4a8), read_tensor_infos(one)
    assert set(dst) == {n for n in src if not n.startswith("model.layers.") or n.startswith("model.layers.0.")}
    assert any(n.startswith("model.layers.0.") for n in dst) and "model.norm.weight" in dst
    for name in dst:
        assert torch.equal(read_tensor(dst[name]), read_tensor(src[name]))
    assert (one / "tokenizer.json").exists()
    verify_checkpoint(one)
    stamp = (one / "config.json").stat().st_mtime_ns
    assert peers.make_first_layer(w4a8) == one and (one / "config.json").stat().st_mtime_ns == stamp
    with pytest.raises(peers.PeerUnavailable, match="nothing to cut"):
        peers.make_first_layer(one)


def test_floor_row_joins_after_ours_and_its_notes(tiny_llama, tmp_path, monkeypatch):
    """--floor adds anychip-w4a8-floor after our rows (a BF16 model gets a skipped row saying why); the report
    puts every system's decode step beside the floor's."""
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    floor = latency.floor_system(ModelDir.open(w4a8))
    assert floor.name == latency.FLOOR and floor.plugin and not floor.skipped and "first of" in floor.notes[0]
    assert "not one" in latency.floor_system(ModelDir.open(tiny_llama())).skipped
    seen = []
    monkeypatch.setattr(latency, "run_system", lambda system, args, workdir: seen.append(system.name) or
                        _latency_row(system.name, 1000, 100))
    monkeypatch.setattr(latency, "warm_python", lambda packages, device: seen.append("warm") or
                        {"packages": list(packages), "device": device, "seconds": 0.1})
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", str(w4a8), "--pp", "128", "--tg", "32", "--floor", "--systems",
                 "anychip-w4a8,anychip-w4a8-floor", "--device", "cpu", "--json", str(out)]) == 0
    assert seen == ["warm", "anychip-w4a8", "anychip-w4a8-floor"]  # the warm-up once, before the first engine
    seen.clear()  # naming the floor row in --systems is enough; --no-warm-python skips the warm-up
    assert main(["bench", "latency", str(w4a8), "--pp", "128", "--tg", "32", "--systems", "anychip-w4a8-floor",
                 "--device", "cpu", "--no-warm-python"]) == 0
    assert seen == ["anychip-w4a8-floor"]
    seen.clear()  # --floor beside a --systems list that leaves the row out still adds it (probe47)
    assert main(["bench", "latency", str(w4a8), "--pp", "128", "--tg", "32", "--floor", "--systems", "anychip-w4a8",
                 "--device", "cpu", "--no-warm-python"]) == 0
    assert seen == ["anychip-w4a8", "anychip-w4a8-floor"]
    seen.clear()  # a peer named without --peers: said, not an empty report (probe46)
    assert main(["bench", "latency", str(w4a8), "--pp", "128", "--tg", "32", "--systems", "vllm-bf16",
                 "--device", "cpu", "--no-warm-python"]) == 2
    assert seen == []
    rows = [_latency_row(latency.OURS, 2000, 150), _latency_row(latency.FLOOR, 2000, 250),
            _latency_row("llama.cpp-q4_0", 500, 100)]
    (note,) = latency.floor_notes(rows)
    assert "anychip-w4a8-floor decodes in 4.00 ms a token" in note
    assert "anychip-w4a8 6.67 ms (1.67x)" in note and "llama.cpp-q4_0 10.00 ms (2.50x)" in note
    assert latency.floor_notes(rows[:1]) == []


def test_floor_row_skips_the_batch_run(tiny_llama, tmp_path):
    """--batch applies to our row, not to the floor's: the floor row is there for its decode step."""
    from anychip.checkpoint.quantize import quantize_checkpoint
    from anychip.checkpoint.scheme import W4A8Scheme

    w4a8 = quantize_checkpoint(tiny_llama(), tmp_path / "w4a8", W4A8Scheme(group_size=32))
    md = ModelDir.open(w4a8)
    args = argparse.Namespace(pp=16, tg=8, reps=1, wait_idle=0, threads=2, eager=True, budget_s=10,
                              graph_tokens=None, device="cpu", batch=64, compile_cache="shared")
    specs = {s.name: latency._system_spec(s, args, tmp_path)[1]
             for s in (latency.plan_systems(md, False)[0], latency.floor_system(md))}
    assert specs[latency.OURS].batch == 64 and specs[latency.FLOOR].batch == 0


def test_bench_flags_out_of_range_and_a_short_context_are_one_line_errors(tiny_llama, capsys):
    from anychip.cli import main

    model = str(tiny_llama())  # max_position_embeddings 256
    for flags, says in ((["--pp", "0"], "--pp must be at least 1, got 0"), (["--threads", "0"], "--threads 0"),
                        (["--reps", "-1"], "--reps must be at least 1"),
                        ([], "--pp 512 --tg 128 need a 528-token context")):
        assert main(["bench", "latency", model, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("anychip bench: error: ") and says in err, err


def test_a_json_path_that_would_lose_the_report_is_refused_before_measuring(tmp_path, capsys):
    """probe46: `--json X.md` wrote the Markdown over the JSON; a folder failed after the whole measurement."""
    from anychip.bench.report import check_json_path
    from anychip.cli import main

    check_json_path(None)
    check_json_path(tmp_path / "new" / "bench.json")
    for bad, says in ((tmp_path / "r.md", "would be overwritten"), (tmp_path / "r.png", "would be overwritten"),
                      (tmp_path, "is a folder")):
        with pytest.raises(AnychipError, match=says):
            check_json_path(bad)
    for command in (["bench", "kernels"], ["bench", "latency"], ["bench", "serve", "http://127.0.0.1:9"]):
        assert main([*command, "--json", str(tmp_path / "r.md")]) == 2
        assert "would be overwritten" in capsys.readouterr().err


def test_a_benchmark_child_ends_with_the_bench_that_started_it(tmp_path):
    """probe46: `kill <bench pid>` left its runner measuring, an orphan holding its engine's memory. A child
    started with die_with_parent gets SIGTERM when its parent ends (Linux)."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from anychip.bench.peers import die_with_parent\n"
        f"p = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n")])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # ended, not yet reaped by init
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived the process that started it")


def test_bench_numbers_that_make_no_sense_are_refused_at_parse_time(capsys):
    """probe46: `--num-prompts -4` reported "0/-4 ok", `--timeout-s 0` failed every request, `--concurrency 0`
    started the server first, `--peak-tflops -1` ended in a traceback after measuring, `--budget-s -1000` timed
    out a system after -100 s."""
    for argv in (["bench", "serve", "http://127.0.0.1:9", "--num-prompts", "-4"],
                 ["bench", "serve", "http://127.0.0.1:9", "--timeout-s", "0"],
                 ["bench", "serve", "http://127.0.0.1:9", "--concurrency", "1,0"],
                 ["bench", "serve", "http://127.0.0.1:9", "--peak-tflops", "-1"],
                 ["bench", "serve", "http://127.0.0.1:9", "--scale", "nan"],
                 ["bench", "latency", "--budget-s", "-1000"],
                 ["bench", "latency", "--graph-tokens", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "must be above 0" in err or "at least 1" in err, (argv, err)


def test_append_onto_a_file_that_is_not_that_benchmarks_report_is_refused(tmp_path):
    """probe46: bench serve overwrote a corrupt --append file silently and failed after measuring on a latency
    report; bench latency raised a JSONDecodeError traceback."""
    from anychip.bench.latency import _read_report
    from anychip.bench.serve import read_serve_report

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    other = tmp_path / "latency.json"
    other.write_text(json.dumps({"benchmark": "latency", "rows": []}))
    assert read_serve_report(tmp_path / "none.json") is None and _read_report(tmp_path / "none.json") is None
    for path in (bad, other):
        with pytest.raises(AnychipError, match="not a bench serve report"):
            read_serve_report(path)
    with pytest.raises(AnychipError, match="not a bench latency report"):
        _read_report(bad)
    assert _read_report(other)["benchmark"] == "latency"


def test_device_cuda_without_a_gpu_is_named(monkeypatch):
    from anychip.bench.latency import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AnychipError, match="--device cuda: this Python has"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"
