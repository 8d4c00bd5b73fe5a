"""The torch reference's answers for a few W4A8 cases, written to files the torch-free Arm driver checks.

The driver (tests/arm/driver.cpp) runs under qemu-aarch64 without torch; these files tie its scalar reference and
its kernels to the project's oracle (anychip/kernels/reference.py) and to the Python weight layouts.
tests/test_arm_fixtures.py recomputes every expected array from the stored inputs; regenerate with

    .venv/bin/python tests/arm/fixtures.py        # writes tests/fixtures/arm/*.bin

File layout (little endian): 8-byte magic b"ANYW4A8\\0", then int32 version, M, K, N, G, x_dtype (0 fp32, 1 bf16,
2 fp16), has_bias, exact (1: the fp32 output equals the float64 reference exactly), then the arrays in FIELDS order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from anychip.kernels.reference import group_dot_ref, quantize_activations_ref, w4a8_linear_ref
from anychip.kernels.routes.arm_neon import pair_layout
from anychip.kernels.routes.cpu_x86 import blocked_layout

DIR = Path(__file__).resolve().parents[1] / "fixtures" / "arm"
MAGIC = b"ANYW4A8\0"
VERSION = 1
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (name, dtype) of the arrays after the header; x is in the case's x_dtype, bias only when has_bias.
FIELDS = ("x", "wq", "sw", "bias", "xq", "sx", "dots", "y", "blocked", "blocked_scales", "pair")


@dataclass(frozen=True)
class Case:
    m: int
    k: int
    n: int
    g: int
    x_dtype: torch.dtype
    bias: bool
    exact: bool = False  # power-of-two scales: every partial sum is an exact fp32

    @property
    def name(self) -> str:
        kind = str(self.x_dtype).split(".")[-1] + ("-bias" if self.bias else "") + ("-exact" if self.exact else "")
        return f"M{self.m}-K{self.k}-N{self.n}-G{self.g}-{kind}"


CASES = (
    Case(3, 576, 17, 32, torch.float32, bias=True),
    Case(7, 2048, 20, 128, torch.bfloat16, bias=False),
    Case(1, 576, 33, 64, torch.float16, bias=True),
    Case(5, 576, 24, 64, torch.float32, bias=False, exact=True),
)


def inputs(case: Case, seed: int) -> dict[str, torch.Tensor]:
    """x, wq, sw (and bias) of a case, with the awkward values: the int4 extremes, an all-zero token, ties."""
    gen = torch.Generator().manual_seed(seed)
    m, k, n, g = case.m, case.k, case.n, case.g
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    wq[0, :g] = -8
    wq[-1, -g:] = 7
    x = torch.randn(m, k, generator=gen) * 3
    if case.exact:
        # amax = 127 * 2^-e: the token scale is exactly 2^-e; one power of two per weight row
        e = torch.randint(0, 4, (m, 1), generator=gen).float()
        x = torch.clamp(x, -100, 100)
        x[:, 0] = 127
        x = x * 2.0**-e
        sw = (2.0 ** -torch.randint(0, 6, (n, 1), generator=gen).float()).expand(n, k // g).contiguous()
    else:
        sw = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    if m > 2:
        x[1] = 0  # scale 0, q 0
    if m > 3 and not case.exact:
        x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])  # amax 127: halves are ties
        x[2, 8:] = 0.25
    out = {"x": x.to(case.x_dtype), "wq": wq, "sw": sw}
    if case.bias:
        out["bias"] = torch.randn(n, generator=gen) * 0.1
    return out


def expected(case: Case, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the reference and the Python layouts make of a case's inputs."""
    xq, sx = quantize_activations_ref(arrays["x"])
    y = w4a8_linear_ref(xq, sx, arrays["wq"], arrays["sw"], arrays.get("bias"), out_dtype=torch.float64)
    blocked, blocked_scales = blocked_layout(arrays["wq"], arrays["sw"])
    return {"xq": xq, "sx": sx.view(-1), "dots": group_dot_ref(xq, arrays["wq"], case.g), "y": y,
            "blocked": blocked, "blocked_scales": blocked_scales, "pair": pair_layout(blocked)}


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def write(case: Case, path: Path, seed: int) -> None:
    arrays = inputs(case, seed)
    arrays |= expected(case, arrays)
    head = MAGIC + struct.pack("<8i", VERSION, case.m, case.k, case.n, case.g, X_DTYPES.index(case.x_dtype),
                               int(case.bias), int(case.exact))
    path.write_bytes(head + b"".join(_raw(arrays[f]) for f in FIELDS if f in arrays))


def read(path: Path) -> tuple[Case, dict[str, torch.Tensor]]:
    data = path.read_bytes()
    if data[:8] != MAGIC:
        raise ValueError(f"{path}: not an anychip W4A8 fixture (magic {data[:8]!r})")
    version, m, k, n, g, xd, has_bias, exact = struct.unpack_from("<8i", data, 8)
    if version != VERSION:
        raise ValueError(f"{path}: fixture version {version}, this reader knows {VERSION}: regenerate it")
    case = Case(m, k, n, g, X_DTYPES[xd], bool(has_bias), bool(exact))
    nb, groups = -(-n // 16), k // g
    shapes = {"x": ((m, k), case.x_dtype), "wq": ((n, k), torch.int8), "sw": ((n, groups), torch.float32),
              "bias": ((n,), torch.float32), "xq": ((m, k), torch.int8), "sx": ((m,), torch.float32),
              "dots": ((m, n, groups), torch.int32), "y": ((m, n), torch.float64),
              "blocked": ((nb, k // 8, 64), torch.uint8), "blocked_scales": ((nb, groups, 16), torch.float32),
              "pair": ((nb, k // 16, 128), torch.uint8)}
    offset, arrays = 8 + 8 * 4, {}
    for f in FIELDS:
        if f == "bias" and not has_bias:
            continue
        shape, dtype = shapes[f]
        count = 1
        for s in shape:
            count *= s
        size = count * dtype.itemsize
        raw = torch.frombuffer(bytearray(data[offset:offset + size]), dtype=torch.uint8)
        arrays[f] = raw.view(dtype).view(shape)
        offset += size
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes after the last array")
    return case, arrays


def paths() -> list[Path]:
    return [DIR / f"{c.name}.bin" for c in CASES]


def main() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    for i, (case, path) in enumerate(zip(CASES, paths())):
        write(case, path, seed=100 + i)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
