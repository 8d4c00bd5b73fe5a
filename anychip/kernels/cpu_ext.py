"""Builds and loads the C++ W4A8 extension (csrc/w4a8_cpu.cpp) on first use.

One binary serves every CPU of an architecture (the SIMD paths carry function-level target attributes and are
chosen at run time), but the build is still cached per CPU-feature set, torch version and csrc/ hash under the
build folder of the kernel policy (KernelPolicy.build_dir), so a cache shared between machines (NFS home, container
image) never hands one CPU a binary compiled and tested on another.

The build compiles a copy of csrc/ kept inside its own folder, and the folder's name also carries the torch
installation it compiles against: torch's builder recompiles whenever its build file changes, and that file names
the source and include paths. Compiled from csrc/ where it lies, two checkouts (or venvs) with the same sources
shared one folder and rebuilt it in turn, a minute of engine start at every switch.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from anychip.errors import AnychipError
from anychip.kernels import machine

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "w4a8_cpu.cpp"  # includes cpu_common.h and quantize_act.h
HEAD_SOURCE = CSRC / "head_cpu.cpp"  # the output head; registers torch.ops.anychip.head_* from C++
ATTENTION_SOURCE = CSRC / "attention_cpu.cpp"  # vLLM's CPU attention step from C++ (vllm_plugin/cpu_attention.py)
DEFAULT_BUILD_DIR = Path.home() / ".cache" / "anychip" / "torch_extensions"
_module: ModuleType | None = None  # the loaded extension (process lifetime, like any imported module)


class ExtensionBuildError(AnychipError, RuntimeError):
    """The C++ kernels failed to compile or load."""


def feature_tag() -> str:
    """`x86_64-<hash of the CPU flags>`: the key the build cache is split by."""
    flags = " ".join(sorted(machine.cpu_flags()))
    return f"{platform.machine()}-{hashlib.sha1(flags.encode()).hexdigest()[:10]}"


def load(build_dir: Path | None = None) -> ModuleType:
    """The compiled extension, built under `build_dir` (default DEFAULT_BUILD_DIR) on the first call in a fresh
    cache (about a minute); later calls return the loaded module whatever they pass."""
    global _module
    if _module is None:
        _module = _build(Path(build_dir) if build_dir is not None else DEFAULT_BUILD_DIR)
    return _module


def loaded() -> ModuleType | None:
    """The extension if this process has loaded it, else None (never builds)."""
    return _module


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.[ch]*"))


def build_folder(build_dir: Path) -> Path:
    """Where this csrc/, CPU and torch installation build: keyed by the sources' contents (not where they lie) and
    by the torch installation (its headers and libraries are paths in the build file)."""
    src_hash = hashlib.sha1(b"".join(f.name.encode() + f.read_bytes() for f in _sources())).hexdigest()[:10]
    torch_tag = torch.__version__.split("+")[0].replace(".", "_")
    torch_dir = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    return build_dir / f"w4a8_cpu-{feature_tag()}-torch{torch_tag}-{torch_dir}-{src_hash}"


def stage_sources(build: Path) -> Path:
    """The copy of csrc/ that `build` compiles (build/src), written once: a file already there has these contents
    (the folder is named by their hash) and is left alone, so its time stamp never makes the build stale."""
    src = build / "src"
    src.mkdir(parents=True, exist_ok=True)
    for f in _sources():
        target = src / f.name
        if not target.exists():
            tmp = src / f".{f.name}.{os.getpid()}.tmp"
            tmp.write_bytes(f.read_bytes())
            os.replace(tmp, target)  # atomic: a concurrent build never compiles half a file
    return src


def _build(build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    build = build_folder(build_dir)
    src = stage_sources(build)
    if not (build / "anychip_w4a8_cpu.so").exists():  # a minute of silence otherwise, at a first engine start
        print(f"anychip: compiling the CPU kernels for this machine into {build} (about a minute, once per CPU kind "
              "and torch)", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(
            name="anychip_w4a8_cpu",
            sources=[str(src / f.name) for f in (SOURCE, HEAD_SOURCE, ATTENTION_SOURCE)],
            build_directory=str(build),
            extra_cflags=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # compiler missing, headers missing, ...
        raise ExtensionBuildError(
            f"could not build the anychip CPU kernels from {SOURCE} in {build}: {e}\n"
            "Check that a C++17 compiler (g++) and ninja are installed, or set ANYCHIP_BUILD_DIR to a writable "
            "directory; ANYCHIP_KERNEL_ISA=reference with ANYCHIP_ALLOW_FALLBACK=1 runs the (slow) torch reference "
            "instead."
        ) from e
