"""Hardware profile: detect the CPU and derive the vLLM settings that serve best on it, with a reason for each.

Imports no vLLM: `anychip serve` turns the settings into flags and environment for vLLM's OpenAI server.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from anychip import cuda_graphs
from anychip.envs import VLLM_CPU_COMPILATION, VLLM_CPU_STARTUP, VLLM_STARTUP
from anychip.errors import AnychipError

# Features that matter to our kernels, by architecture (names as /proc/cpuinfo spells them).
_X86_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "avx2", "fma")
_ARM_FEATURES = ("asimd", "asimddp", "i8mm", "bf16", "sve", "sve2")


class ProfileError(AnychipError, ValueError):
    """The requested serving layout does not fit this machine; the message says what does."""


@dataclass(frozen=True)
class CpuInfo:
    arch: str
    model: str
    features: tuple[str, ...]
    logical_cpus: int
    physical_cores: int
    serving_cpus: tuple[int, ...]  # the CPUs to bind OpenMP threads to (big cores on big.LITTLE)
    memory_gib: float
    why_cpus: str

    @property
    def profile_name(self) -> str:
        isa = "generic"
        if self.arch == "x86_64":
            isa = "avx512_vnni" if "avx512_vnni" in self.features else ("avx2" if "avx2" in self.features else "x86")
        elif self.arch == "aarch64":
            isa = "i8mm" if "i8mm" in self.features else ("dotprod" if "asimddp" in self.features else "neon")
        return f"{self.arch}-{isa}-{len(self.serving_cpus)}c"


@dataclass(frozen=True)
class Setting:
    name: str  # a vLLM flag (--x) or an environment variable
    value: str
    reason: str
    kind: str = "flag"  # "flag" or "env"
    yields_to: tuple[str, ...] = ()  # user flags besides `name` that make a flag setting step aside

    def argv(self) -> list[str]:
        """A flag setting as command-line arguments: the flag, and its value unless it takes none."""
        return [self.name] if self.value == "" else [self.name, self.value]


@dataclass
class Profile:
    cpu: CpuInfo
    settings: list[Setting] = field(default_factory=list)

    def flags(self) -> list[str]:
        return [arg for s in self.settings if s.kind == "flag" for arg in s.argv()]

    def env(self) -> dict[str, str]:
        return {s.name: s.value for s in self.settings if s.kind == "env"}


# Arm Ltd. (MIDR implementer 0x41) cores by part number, for the profile's model line.  The in-order efficiency
# cores (LITTLE) are left out of serving whenever faster cores sit beside them: a decode step waits for its slowest
# thread's share of the weight stream.
_ARM_PARTS = {0xd03: "Cortex-A53", 0xd04: "Cortex-A35", 0xd05: "Cortex-A55", 0xd07: "Cortex-A57",
              0xd08: "Cortex-A72", 0xd09: "Cortex-A73", 0xd0a: "Cortex-A75", 0xd0b: "Cortex-A76",
              0xd0c: "Neoverse-N1", 0xd0d: "Cortex-A77", 0xd40: "Neoverse-V1", 0xd41: "Cortex-A78",
              0xd44: "Cortex-X1", 0xd46: "Cortex-A510", 0xd47: "Cortex-A710", 0xd48: "Cortex-X2",
              0xd49: "Neoverse-N2", 0xd4d: "Cortex-A715", 0xd4e: "Cortex-X3", 0xd4f: "Neoverse-V2",
              0xd80: "Cortex-A520", 0xd81: "Cortex-A720", 0xd82: "Cortex-X4", 0xd84: "Neoverse-V3",
              0xd85: "Cortex-X925", 0xd87: "Cortex-A725", 0xd8e: "Neoverse-N3"}
_ARM_LITTLE = frozenset({0xd03, 0xd04, 0xd05, 0xd46, 0xd80})
_ROOT = Path("/")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (the kernel's cpulist syntax)."""
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def _online_cpus(root: Path, blocks: list[dict[str, str]]) -> list[int]:
    """The CPUs this process may run on; under another root, the tree's online list (else its cpuinfo)."""
    if root == _ROOT:
        try:
            return sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return list(range(os.cpu_count() or 1))
    online = _read(root / "sys/devices/system/cpu/online")
    if online:
        return _parse_cpu_list(online)
    return sorted(int(b["processor"]) for b in blocks if b.get("processor", "").isdigit()) or [0]


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks = []
    for chunk in text.split("\n\n"):
        entry = {}
        for line in chunk.splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                entry[k.strip()] = v.strip()
        if entry:
            blocks.append(entry)
    return blocks


def _cpu_dir(root: Path, cpu: int) -> Path:
    return root / f"sys/devices/system/cpu/cpu{cpu}"


def _physical_cores(root: Path, cpus: list[int]) -> tuple[int, dict[int, tuple[str, ...]]]:
    """Distinct physical cores among `cpus`; SMT siblings count once. A core is its thread_siblings_list where the
    kernel writes one (it groups CPUs by package, cluster and core), else (package, cluster, core id): device-tree
    Arm boards number core_id from 0 again in every cluster (an RK3588's big cores: 0 1 | 0 1), so package and
    core id alone would take the second cluster's cores for SMT siblings of the first's."""
    core_of: dict[int, tuple[str, ...]] = {}
    for cpu in cpus:
        base = _cpu_dir(root, cpu) / "topology"
        siblings = _read(base / "thread_siblings_list")
        core_of[cpu] = (("siblings", siblings) if siblings else
                        (_read(base / "physical_package_id") or "0", _read(base / "cluster_id") or "",
                         _read(base / "core_id") or str(cpu)))
    return len(set(core_of.values())), core_of


def _arm_core_types(root: Path, cpus: list[int], blocks: list[dict[str, str]]) -> dict[int, tuple[int, int]]:
    """{cpu: (MIDR implementer, part number)} from sysfs midr_el1, else /proc/cpuinfo; CPUs with neither are absent."""
    by_processor = {int(b["processor"]): b for b in blocks if b.get("processor", "").isdigit()}
    types = {}
    for c in cpus:
        midr = _read(_cpu_dir(root, c) / "regs/identification/midr_el1")
        block = by_processor.get(c, {})
        try:
            if midr:
                types[c] = ((int(midr, 16) >> 24) & 0xFF, (int(midr, 16) >> 4) & 0xFFF)
            elif "CPU implementer" in block and "CPU part" in block:
                types[c] = (int(block["CPU implementer"], 16), int(block["CPU part"], 16))
        except ValueError:
            continue
    return types


def _core_name(kind: tuple[int, int]) -> str:
    implementer, part = kind
    return _ARM_PARTS.get(part, f"part 0x{part:03x}") if implementer == 0x41 else f"0x{implementer:02x}:0x{part:03x}"


def _arm_model(types: dict[int, tuple[int, int]]) -> str | None:
    """'8x Cortex-A720 + 4x Cortex-A520' (in CPU order), None when the core types are unknown."""
    if not types:
        return None
    counts: dict[tuple[int, int], int] = {}
    for kind in types.values():
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n}x {_core_name(k)}" for k, n in counts.items())


def _big_cores(root: Path, cpus: list[int], types: dict[int, tuple[int, int]]) -> tuple[list[int], str]:
    """Arm serving cores: every core type but the LITTLE ones (by MIDR part) when both kinds are present, else the
    highest-capacity cores (cpu_capacity >= 80% of the top), else all."""
    if len(types) == len(cpus) and len(set(types.values())) > 1:
        little = [c for c in cpus if types[c][0] == 0x41 and types[c][1] in _ARM_LITTLE]
        if 0 < len(little) < len(cpus):
            names = sorted({_core_name(types[c]) for c in little})
            return ([c for c in cpus if c not in little],
                    f"{', '.join(names)} (CPUs {_cpu_list(tuple(little))}) left out: LITTLE cores")
    capacity = {c: _read(_cpu_dir(root, c) / "cpu_capacity") for c in cpus}
    if all(v and v.isdigit() for v in capacity.values()) and len(set(capacity.values())) > 1:
        top = max(int(v) for v in capacity.values())
        big = [c for c in cpus if int(capacity[c]) >= 0.8 * top]
        return big, f"big cores by cpu_capacity (>= 80% of {top})"
    return cpus, "all online CPUs (no big.LITTLE topology found)"


def detect_cpu(root: Path = _ROOT, arch: str | None = None) -> CpuInfo:
    """This machine's CPU, or the one recorded under `root` (a copy of /proc and /sys/devices/system/cpu; arch then
    defaults to what its cpuinfo says)."""
    root = Path(root)
    text = _read(root / "proc/cpuinfo") or ""
    blocks = _cpuinfo_blocks(text)
    if arch is None:
        arch = platform.machine() if root == _ROOT else ("aarch64" if "CPU implementer" in text else "x86_64")
    is_arm = arch in ("aarch64", "arm64")
    cpus = _online_cpus(root, blocks)
    flag_sets = [set((b.get("flags") or b.get("Features") or "").split()) for b in blocks
                 if b.get("flags") or b.get("Features")]
    flags = set.intersection(*flag_sets) if flag_sets else set()  # what every core has
    wanted = _ARM_FEATURES if is_arm else _X86_FEATURES
    features = tuple(f for f in wanted if f in flags)
    first = blocks[0] if blocks else {}
    types = _arm_core_types(root, cpus, blocks) if is_arm else {}
    model = (first.get("model name") or _arm_model(types) or first.get("CPU part")
             or (platform.processor() if root == _ROOT else "") or arch)
    serving, why = _big_cores(root, cpus, types) if is_arm else (cpus, "all online CPUs")
    physical, core_of = _physical_cores(root, serving)
    if physical < len(serving):  # one thread per physical core: SMT siblings share the vector units
        seen, one_per_core = set(), []
        for c in serving:
            if core_of[c] not in seen:
                seen.add(core_of[c])
                one_per_core.append(c)
        serving, why = one_per_core, why + ", one logical CPU per physical core"
    mem_kib = next((int(line.split()[1]) for line in (_read(root / "proc/meminfo") or "").splitlines()
                    if line.startswith("MemTotal:")), 0)
    return CpuInfo(arch=arch, model=model, features=features, logical_cpus=len(cpus), physical_cores=physical,
                   serving_cpus=tuple(serving), memory_gib=round(mem_kib / 2**20, 1), why_cpus=why)


def _cpu_list(cpus: tuple[int, ...]) -> str:
    """(0,1,2,5) -> '0-2,5' (the syntax VLLM_CPU_OMP_THREADS_BIND takes)."""
    ranges, start, prev = [], None, None
    for c in cpus:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            ranges.append((start, prev))
            start = prev = c
    if start is not None:
        ranges.append((start, prev))
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


def rank_cpus(cpus: list[int], tensor_parallel: int) -> list[list[int]]:
    """The serving CPUs split into one contiguous, equal set per tensor-parallel rank (leftovers unused)."""
    if tensor_parallel < 1:
        raise ValueError(f"tensor parallel size {tensor_parallel}: must be at least 1")
    per = len(cpus) // tensor_parallel
    if per < 1:
        raise ProfileError(f"--tensor-parallel-size {tensor_parallel} needs at least one serving core per rank; this "
                           f"machine serves on {len(cpus)} ({_cpu_list(cpus)}): use at most {len(cpus)}")
    return [cpus[r * per:(r + 1) * per] for r in range(tensor_parallel)]


def serving_device() -> str:
    """"cuda" where torch sees an NVIDIA GPU (vLLM's CUDA build then serves on it), else "cpu"."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_profile(cpu: CpuInfo | None = None, tensor_parallel: int = 1, device: str | None = None,
                  max_num_batched_tokens: int | None = None) -> Profile:
    """The settings for serving on this machine; device "cpu" or "cuda" (default: serving_device());
    max_num_batched_tokens: the step budget the user's flags set (the GPU's capture sizes follow it)."""
    cpu = cpu or detect_cpu()
    device = device or serving_device()
    ranks = rank_cpus(list(cpu.serving_cpus), tensor_parallel)
    n = len(ranks[0])
    kv_gib = max(1, min(16, int(cpu.memory_gib * 0.25)))
    budget = max_num_batched_tokens or (2048 if n <= 8 else 4096)
    if tensor_parallel == 1:
        executor = Setting("--distributed-executor-backend", "uni", "single process executor: one CPU socket, no "
                           "tensor parallel workers")
        bind = Setting("VLLM_CPU_OMP_THREADS_BIND", _cpu_list(ranks[0]),
                       "pin the threads to those cores so decode steps do not migrate", "env")
    else:
        executor = Setting("--distributed-executor-backend", "mp", f"one worker process per tensor-parallel rank "
                           f"({tensor_parallel})")
        bind = Setting("VLLM_CPU_OMP_THREADS_BIND", "|".join(_cpu_list(r) for r in ranks),
                       f"each rank's threads pinned to its own {n} core(s)", "env")
    settings = [
        Setting("OMP_NUM_THREADS", str(n), f"one OpenMP thread per serving core of a rank ({cpu.why_cpus})", "env"),
        bind,
        Setting("VLLM_CPU_KVCACHE_SPACE", str(kv_gib),
                f"KV cache of {kv_gib} GiB (a quarter of {cpu.memory_gib} GiB RAM, at most 16): vLLM otherwise "
                "sizes it from NUMA node memory", "env"),
        *(Setting(name, value, "no process hop a step: offline LLM(...) keeps its engine in the calling process "
                  "(doubled decode speed on 2 cores); the OpenAI server, whose engine has a process of its own "
                  "anyway, runs the model in that process instead of one more worker", "env")
          for name, value in VLLM_STARTUP.items()),
        executor,
        Setting("--max-num-batched-tokens", str(budget),
                "prefill chunk that keeps the W4A8 GEMM in its tiled path without starving decode"),
        Setting("--dtype", "bfloat16", "activations in BF16 (the W4A8 kernels take BF16 in and out)"
                if "avx512_bf16" in cpu.features or "bf16" in cpu.features else
                "BF16 storage halves activation traffic even without native BF16 arithmetic"),
    ]
    if device == "cpu":
        settings.extend(Setting(name, value, "vLLM's CPU engines cannot load the forward they compile ahead of time "
                                "and compile it again at every start; off, vLLM's compile cache serves a warm start "
                                "(about 13 s instead of 37-50 s for the default model)", "env")
                        for name, value in VLLM_CPU_STARTUP.items())
        settings.append(Setting("--compilation-config", json.dumps(VLLM_CPU_COMPILATION),
                                "one compiled graph for the whole forward: the pieces between attention calls only "
                                "serve CUDA graphs, and each costs a Python call per step", yields_to=("-cc",)))
    else:
        settings.append(Setting("--compilation-config",
                                json.dumps({"cudagraph_capture_sizes": cuda_graphs.capture_sizes(budget)}),
                                f"CUDA graphs for prefill steps too, up to the {budget}-token budget (vLLM's sizes to "
                                "512, then four an octave): an eager W4A8 linear costs several times a BF16 one's "
                                "host time, and graphs cost it none; the same sizes for any model served so",
                                yields_to=("-cc", "--cudagraph-capture-sizes", "--max-cudagraph-capture-size",
                                           "--enforce-eager")))
    return Profile(cpu=cpu, settings=settings)


def cmd_profile(args) -> int:
    profile = build_profile()
    if args.json:
        print(json.dumps({"cpu": asdict(profile.cpu), "profile": profile.cpu.profile_name,
                          "settings": [asdict(s) for s in profile.settings]}, indent=1))
        return 0
    cpu = profile.cpu
    print(f"CPU      {cpu.model} ({cpu.arch}), {cpu.logical_cpus} logical CPUs, {cpu.physical_cores} physical cores")
    print(f"features {' '.join(cpu.features) or '(none of interest)'}")
    print(f"serving  CPUs {_cpu_list(cpu.serving_cpus)}: {cpu.why_cpus}")
    print(f"profile  {cpu.profile_name}")
    print("vLLM settings:")
    for s in profile.settings:
        shown = f"{s.name}={s.value}" if s.kind == "env" else f"{s.name} {s.value}".strip()
        print(f"  {shown:<42} {s.reason}")
    return 0
