"""Session 41: registers and main-loop instructions (a warp, a group of 128) of the W4A8 prefill GEMMs, compiled
for sm_90a without a GPU (Triton's CUDA backend, its ptxas and cuobjdump), with the divisibility hints the JIT
gives a launch at M = 4,096, N = 4,096, K = 2,048.

PYTHONPATH=<a Triton 3.6 site-packages>:$PWD python docs/gpu-runs/session41/sass_counts.py
"""
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).parent))
import gluon_diag  # noqa: E402
import gluon_ws  # noqa: E402
import triton_split  # noqa: E402

from anychip.kernels.gpu import launch, triton_w4a8  # noqa: E402
from anychip.kernels.gpu.launch import GemmConfig  # noqa: E402

try:
    BIN = Path(get_ptxas(90).path).parent
except TypeError:  # Triton 3.6 takes no architecture
    BIN = Path(get_ptxas().path).parent
M, N, K, G = 4096, 4096, 2048, 128
HINTED = ("x_ptr", "w_ptr", "s_ptr", "sx_ptr", "out_ptr", "N", "K", "stride_xm", "stride_om", "M")


def _attrs(kernel, args: dict):
    names = [p.name for p in kernel.params]
    return {(names.index(n),): [["tt.divisibility", 16]] for n in args if n in HINTED}


def sass_of(src, options: dict) -> tuple[str, str]:
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(Path(tmp) / "k.cubin")], capture_output=True,
                              text=True, check=True).stdout
    return sass, run.stderr


def main_loop(sass: str) -> list[str]:
    """Opcodes of the loop with the most wgmma: the span from a backward branch's target to the branch."""
    lines = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(\S[^;]*);", sass)]
    best: list[str] = []
    for addr, op in lines:
        jump = re.search(r"BRA (0x[0-9a-f]+)", op)
        if jump and int(jump.group(1), 16) < addr:
            body = [o for a, o in lines if int(jump.group(1), 16) <= a <= addr]
            if sum("GMMA" in o for o in body) > sum("GMMA" in o for o in best):
                best = body
    return best


def report(name: str, sass: str, log: str, groups_a_trip: int) -> None:
    body = main_loop(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P[0-9T] ", "", o).split()[0].split(".")[0] for o in body)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    rescale = sum(ops[o] for o in ("I2FP", "FFMA", "FMUL"))
    print(f"{name}: {regs} registers, spills {spills}; {len(body) / groups_a_trip:.0f} instructions a warp a group "
          f"(I2FP+FFMA+FMUL {rescale / groups_a_trip:.0f}); {dict(ops.most_common(12))}", flush=True)


def shipped() -> None:
    cfg = GemmConfig(block_m=128, block_n=64, block_k=128, swap=False, split_k=1, num_warps=4, num_stages=4,
                     group_m=8, pipe=False, fcvt=False)
    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int8: "*i8"}
    _, args, opts = launch.gemm_launch(cfg, M, N, K, G, torch.int8, torch.float32, torch.int8, torch.bfloat16, None,
                                       torch.bfloat16, None, None, None, None, K, N)
    kernel = triton_w4a8._w4a8_gemm_kernel
    sig, const = {}, {}
    for p, a in zip(kernel.params, args):
        sig[p.name] = types.get(a, "*i32") if a is None or isinstance(a, torch.dtype) else "i32"
    for p in kernel.params[len(args):]:
        sig[p.name], const[p.name] = "constexpr", opts.get(p.name, p.default)
    hinted = [p.name for p, a in zip(kernel.params, args) if a is None or isinstance(a, torch.dtype)
              or a % 16 == 0]
    names = [p.name for p in kernel.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    sass, log = sass_of(ASTSource(kernel, sig, const, attrs), {k: opts[k] for k in ("num_warps", "num_stages")})
    report("shipped Triton GEMM 128x64 w4 s4", sass, log, 1)


def gluon(unroll=2, bm=128, bn=64, warps=8) -> None:
    half = G // 2
    layout = gl.NVMMASharedLayout(swizzle_byte_width=half, element_bitwidth=8, rank=2)
    xs, w = torch.zeros(bm, K, dtype=torch.int8), torch.zeros(bn, K // 2, dtype=torch.int8)
    sig = {"a_desc": mangle_type(GluonDescriptor(xs, list(xs.shape), [K, 1], [bm, half], layout)),
           "w_desc": mangle_type(GluonDescriptor(w, list(w.shape), [K // 2, 1], [bn, half], layout)),
           "w_ptr": "*i8", "s_ptr": "*bf16", "sx_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "stride_om": "i32"}
    const = dict(G=G, BM=bm, BN=bn, STAGES=4, GROUP_M=8, UNROLL=unroll, WTMA=True, RESCALE=True, WIDEN=True,
                 num_warps=warps)
    sig.update({k: "constexpr" for k in const})
    sass, log = sass_of(GluonASTSource(gluon_diag._kernel, sig, const, _attrs(gluon_diag._kernel, sig)),
                        {"num_warps": warps})
    report(f"Gluon GEMM {bm}x{bn} w{warps} trips of {unroll}, weights by TMA", sass, log, unroll)


def split(tma=True, warps=4, cat=False) -> None:
    xs, w = torch.zeros(128, K, dtype=torch.int8), torch.zeros(64, K // 2, dtype=torch.int8)
    xw = G if cat else G // 2
    sig = {"x_desc": mangle_type(TensorDescriptor.from_tensor(xs, [128, xw])) if tma else "*i8", "x_ptr": "*i8",
           "w_desc": mangle_type(TensorDescriptor.from_tensor(w, [64, G // 2])) if tma else "*i8", "w_ptr": "*i8",
           "s_ptr": "*bf16", "sx_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_om": "i32"}
    const = dict(G=G, BM=128, BN=64, GROUP_M=8, TMA=tma, ASM=True, CAT=cat)
    sig.update({k: "constexpr" for k in const})
    kernel = triton_split.gemm_split_kernel
    sass, log = sass_of(ASTSource(kernel, sig, const, _attrs(kernel, sig)), {"num_warps": warps, "num_stages": 4})
    report(f"Triton GEMM on split-order activations 128x64 w{warps}, {'TMA' if tma else 'pointer loads'}"
           f"{', one dot (CAT)' if cat else ''}", sass, log, 1)


def warp_specialized(unroll=4, warps=8) -> None:
    half = G // 2
    layout = gl.NVMMASharedLayout(swizzle_byte_width=half, element_bitwidth=8, rank=2)
    xs, w = torch.zeros(128, K, dtype=torch.int8), torch.zeros(64, K // 2, dtype=torch.int8)
    sig = {"a_desc": mangle_type(GluonDescriptor(xs, list(xs.shape), [K, 1], [128, half], layout)),
           "w_desc": mangle_type(GluonDescriptor(w, list(w.shape), [K // 2, 1], [64, half], layout)),
           "s_ptr": "*bf16", "sx_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_om": "i32"}
    const = dict(G=G, BM=128, BN=64, STAGES=4, GROUP_M=8, UNROLL=unroll, num_warps=warps)
    sig.update({k: "constexpr" for k in const})
    sass, log = sass_of(GluonASTSource(gluon_ws.ws_kernel, sig, const, _attrs(gluon_ws.ws_kernel, sig)),
                        {"num_warps": warps})
    report(f"warp-specialized Gluon GEMM 128x64, {warps} consumer warps, trips of {unroll} (the consumers' loop)",
           sass, log, unroll)


if __name__ == "__main__":
    shipped()
    gluon()
    gluon(unroll=8)
    split(tma=False)
    split(tma=True)
    split(tma=False, cat=True)
    split(tma=True, cat=True)
    warp_specialized()
