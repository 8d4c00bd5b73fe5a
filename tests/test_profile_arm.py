"""`anychip profile` on Arm machines, from the CPU trees in tests/fixtures/cpu (see its README)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from anychip.profile import build_profile, detect_cpu

TREES = Path(__file__).parent / "fixtures" / "cpu"

# tree: (model, serving CPUs, OpenMP binding, profile name, features present, features absent)
EXPECTED = {
    "cix-p1": ("8x Cortex-A720 + 4x Cortex-A520", (0, 1, 6, 7, 8, 9, 10, 11), "0-1,6-11", "aarch64-i8mm-8c",
               {"asimddp", "i8mm", "bf16", "sve2"}, set()),
    "graviton3": ("16x Neoverse-V1", tuple(range(16)), "0-15", "aarch64-i8mm-16c",
                  {"asimddp", "i8mm", "bf16", "sve"}, {"sve2"}),
    "snapdragon-8-gen-1": ("4x Cortex-A510 + 3x Cortex-A710 + 1x Cortex-X2", (4, 5, 6, 7), "4-7", "aarch64-i8mm-4c",
                           {"asimddp", "i8mm"}, {"sve"}),
}


@pytest.mark.parametrize("tree", sorted(EXPECTED))
def test_profile_of_a_recorded_arm_tree(tree: str) -> None:
    model, serving, bind, name, has, lacks = EXPECTED[tree]
    cpu = detect_cpu(TREES / tree)
    assert cpu.arch == "aarch64" and cpu.model == model
    assert cpu.serving_cpus == serving and cpu.physical_cores == len(serving)
    assert has <= set(cpu.features) and not lacks & set(cpu.features)
    assert cpu.profile_name == name
    env = build_profile(cpu).env()
    assert env["OMP_NUM_THREADS"] == str(len(serving)) and env["VLLM_CPU_OMP_THREADS_BIND"] == bind


def test_little_cores_are_named_in_the_reason() -> None:
    cix = detect_cpu(TREES / "cix-p1")
    assert "Cortex-A520 (CPUs 2-5) left out" in cix.why_cpus
    assert "Cortex-A510 (CPUs 0-3) left out" in detect_cpu(TREES / "snapdragon-8-gen-1").why_cpus
    assert "all online CPUs" in detect_cpu(TREES / "graviton3").why_cpus
    # the 80% cpu_capacity rule alone would have dropped the slowest A720 cluster (CPUs 10-11, capacity 787)
    assert (TREES / "cix-p1/sys/devices/system/cpu/cpu10/cpu_capacity").read_text().strip() == "787"


def _copy(tree: str, tmp_path: Path) -> Path:
    root = tmp_path / tree
    shutil.copytree(TREES / tree, root)
    return root


def test_core_types_from_cpuinfo_when_sysfs_has_no_midr(tmp_path: Path) -> None:
    root = _copy("cix-p1", tmp_path)
    for regs in root.glob("sys/devices/system/cpu/cpu*/regs"):
        shutil.rmtree(regs)
    cpu = detect_cpu(root)
    assert cpu.serving_cpus == EXPECTED["cix-p1"][1] and cpu.model == EXPECTED["cix-p1"][0]


def test_capacity_decides_between_cores_of_one_type(tmp_path: Path) -> None:
    root = _copy("graviton3", tmp_path)
    for c in (14, 15):
        (root / f"sys/devices/system/cpu/cpu{c}/cpu_capacity").write_text("400\n")
    cpu = detect_cpu(root)
    assert cpu.serving_cpus == tuple(range(14)) and "cpu_capacity" in cpu.why_cpus


def test_offline_cpus_and_smt_siblings_are_left_out(tmp_path: Path) -> None:
    root = _copy("graviton3", tmp_path)
    (root / "sys/devices/system/cpu/online").write_text("0-7\n")
    for c in range(4, 8):  # CPUs 4-7 share cores 0-3 (SMT)
        (root / f"sys/devices/system/cpu/cpu{c}/topology/core_id").write_text(f"{c - 4}\n")
    cpu = detect_cpu(root)
    assert cpu.logical_cpus == 8 and cpu.serving_cpus == (0, 1, 2, 3) and cpu.physical_cores == 4
    assert build_profile(cpu).env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


@pytest.mark.parametrize("how", ["cluster_id", "thread_siblings_list"])
def test_core_ids_that_restart_in_each_cluster_are_not_smt(tmp_path: Path, how: str) -> None:
    """Device-tree boards (an RK3588, Apple M1 Pro under Asahi) number core_id from 0 in every cluster; the cores
    of two clusters are told apart by cluster_id or the kernel's thread_siblings_list, not taken for SMT twins."""
    root = _copy("cix-p1", tmp_path)
    clusters = {c: (0 if c < 2 else 1 if c < 6 else 2 + (c - 6) // 2) for c in range(12)}
    for c in range(12):
        topo = root / f"sys/devices/system/cpu/cpu{c}/topology"
        (topo / "core_id").write_text(f"{sum(1 for d in range(c) if clusters[d] == clusters[c])}\n")
        if how == "cluster_id":
            (topo / "cluster_id").write_text(f"{clusters[c]}\n")
        else:
            (topo / "thread_siblings_list").write_text(f"{c}\n")
    cpu = detect_cpu(root)
    assert cpu.serving_cpus == EXPECTED["cix-p1"][1] and cpu.physical_cores == 8
    if how == "thread_siblings_list":  # and SMT the kernel reports is still SMT
        for a, b in ((6, 7), (8, 9)):
            for c in (a, b):
                (root / f"sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").write_text(f"{a},{b}\n")
        assert detect_cpu(root).serving_cpus == (0, 1, 6, 8, 10, 11)


def test_this_machine_still_profiles() -> None:
    cpu = detect_cpu()
    assert cpu.serving_cpus and cpu.logical_cpus >= len(cpu.serving_cpus) and cpu.arch


def test_one_compiled_graph_on_the_cpu_and_pieces_on_a_gpu() -> None:
    """CPU engines compile the whole forward as one graph (no CUDA graphs to split it for); a GPU keeps vLLM's
    piecewise default, which its CUDA graphs need, and captures prefill steps up to the step budget too (the
    user's budget when they set one). The user's own --compilation-config wins (serve_command)."""
    import json

    from anychip.serve import server_command

    cpu = detect_cpu(TREES / "graviton3")
    flags = build_profile(cpu, device="cpu").flags()
    assert json.loads(flags[flags.index("--compilation-config") + 1]) == {"splitting_ops": []}
    from anychip import cuda_graphs

    default = int(flags[flags.index("--max-num-batched-tokens") + 1])  # the profile's own budget
    for budget, given in ((default, None), (8192, 8192)):
        gpu = build_profile(cpu, device="cuda", max_num_batched_tokens=given).flags()
        assert gpu[gpu.index("--max-num-batched-tokens") + 1] == str(budget)
        sizes = json.loads(gpu[gpu.index("--compilation-config") + 1])["cudagraph_capture_sizes"]
        assert sizes == cuda_graphs.capture_sizes(budget) and sizes[-1] == budget
    cmd, _ = server_command(Path("/m"), "127.0.0.1", 8000, ["--max-num-batched-tokens=3000"])
    assert "--max-num-batched-tokens=3000" in cmd and "--max-num-batched-tokens" not in cmd
    cmd, _ = server_command(Path("/m"), "127.0.0.1", 8000, ["--compilation-config", '{"mode": 0}'])
    assert cmd.count("--compilation-config") == 1 and cmd[cmd.index("--compilation-config") + 1] == '{"mode": 0}'


def test_cpu_engines_start_without_aot_compilation():
    """vLLM 0.32's CPU engines cannot load the forward they compile ahead of time (every start compiled again):
    serve's CPU profile and every vLLM system of a CPU benchmark turn it off, the user's value winning; a CUDA
    engine keeps vLLM's default."""
    from anychip.bench import latency

    cpu = detect_cpu(TREES / "graviton3")
    assert build_profile(cpu, device="cpu").env()["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in build_profile(cpu, device="cuda").env()
    stock = latency.System("vllm-bf16", "vllm", "BF16")
    assert latency.system_env(stock, 2, None, device="cpu")["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in latency.system_env(stock, 2, None, device="cuda")
    assert "VLLM_USE_AOT_COMPILE" not in latency.system_env(latency.System("llama.cpp-q4_0", "llama.cpp", "Q4_0"), 2,
                                                            None, device="cpu")


def test_gpu_capture_sizes_step_aside_for_the_users_graph_flags(monkeypatch):
    """vLLM refuses capture sizes given twice (--cudagraph-capture-sizes beside a compilation config's) or a
    --max-cudagraph-capture-size other than their largest: any graph flag of the user's, or a compilation config
    of theirs in any spelling, leaves the profile's list out; other flags keep it."""
    import anychip.profile as profile_mod
    from anychip.serve import server_command

    monkeypatch.setattr(profile_mod, "serving_device", lambda: "cuda")
    cmd, _ = server_command(Path("/m"), "127.0.0.1", 8000, ["--max-model-len", "4096"])
    assert '"cudagraph_capture_sizes"' in cmd[cmd.index("--compilation-config") + 1]
    for user in (["--max-cudagraph-capture-size", "256"], ["--cudagraph-capture-sizes", "1", "2", "4"],
                 ["--enforce-eager"], ["-cc", '{"mode": 0}'], ["--compilation-config.mode=0"],
                 ["--max-cudagraph-capture-size=256"]):
        cmd, _ = server_command(Path("/m"), "127.0.0.1", 8000, user)
        assert not any("cudagraph_capture_sizes" in arg for arg in cmd), user
        assert cmd[-len(user):] == user


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`anychip profile --json | head -c 100`: the pipe closes while the command still writes; it stops with the
    usual SIGPIPE status and no traceback (probe 49)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "anychip.cli", "profile", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command has written anything: its first write fails
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err[-800:]
