"""The Arm routes' Python half, and the fixtures that tie the torch-free Arm driver to the torch reference.

`make test-arm` runs the NEON kernels under qemu-aarch64 (tests/arm/driver.cpp) against tests/fixtures/arm/*.bin.
Here, on the build machine, those files are recomputed from their stored inputs with anychip/kernels/reference.py
and the Python layouts (so they hold the project's oracle, not a copy of the driver's), the x86 build of the same
kernel core is run on them, and the Arm routes' availability, preference and layout are checked.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from anychip.kernels import cpu_ext, machine, routes
from anychip.kernels.policy import KernelPolicy
from anychip.kernels.routes.arm_neon import ArmDotprod, ArmI8mm, pair_layout
from anychip.kernels.routes.base import CheckpointWeights, LinearProblem
from anychip.kernels.routes.cpu_x86 import CppRoute, blocked_layout

_spec = importlib.util.spec_from_file_location("arm_fixtures", Path(__file__).parent / "arm" / "fixtures.py")
fixtures = sys.modules.setdefault("arm_fixtures", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fixtures)

CPP_HERE = [r for r in routes.available("cpu") if isinstance(r, CppRoute)]


def test_fixture_files_are_the_listed_cases() -> None:
    assert sorted(fixtures.DIR.glob("*.bin")) == sorted(fixtures.paths()), "regenerate: python tests/arm/fixtures.py"


@pytest.mark.parametrize("path", fixtures.paths(), ids=lambda p: p.stem)
def test_fixture_holds_the_reference_answers(path: Path) -> None:
    case, stored = fixtures.read(path)
    assert case in fixtures.CASES
    recomputed = fixtures.expected(case, stored)
    for name, want in recomputed.items():
        assert torch.equal(stored[name], want), f"{path.name}: {name} is not what the reference gives"
    if case.exact:  # the power-of-two case: the fp32 answer is the float64 one
        assert torch.equal(stored["y"].float().double(), stored["y"])
    xq = stored["xq"]
    assert (xq.abs() <= 127).all() and xq.abs().max() == 127
    if case.m > 2:
        assert stored["sx"][1] == 0 and not xq[1].any()  # the all-zero token


@pytest.mark.parametrize("route", CPP_HERE, ids=lambda r: r.id)
@pytest.mark.parametrize("path", fixtures.paths(), ids=lambda p: p.stem)
def test_x86_build_of_the_kernel_core_on_the_fixtures(route: CppRoute, path: Path) -> None:
    case, a = fixtures.read(path)
    ext = cpu_ext.load()
    xq, sx = ext.quantize_act(a["x"])
    assert torch.equal(xq, a["xq"]) and torch.equal(sx.view(-1), a["sx"])
    dots = route.group_dots(xq, a["blocked"], a["blocked_scales"], case.n, case.k, case.g)
    assert torch.equal(dots, a["dots"])
    y = route.linear_q(xq, sx, a["blocked"], a["blocked_scales"], a.get("bias"), case.n, case.k, case.g,
                       torch.float32).double()
    ref = a["y"]
    if case.exact:
        assert torch.equal(y, ref)
    else:  # fp32 tolerance, as tests/test_kernels.py
        assert ((y - ref).abs() <= 1e-5 * ref.abs().max() + 1e-5 * ref.abs()).all()


@pytest.mark.parametrize("route", CPP_HERE, ids=lambda r: r.id)
def test_half_outputs_are_the_fp32_output_rounded(route: CppRoute) -> None:
    """The kernel core converts to bf16 / fp16 with its own bit operations: they must round as torch does."""
    case, a = fixtures.read(fixtures.paths()[0])
    xq, sx = a["xq"], a["sx"].view(-1, 1)
    for scale in (1.0, 1e-6, 3e4):  # normal, fp16-subnormal and fp16-overflowing outputs
        args = (xq, sx * scale, a["blocked"], a["blocked_scales"], a.get("bias"), case.n, case.k, case.g)
        y32 = route.linear_q(*args, torch.float32)
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(route.linear_q(*args, dtype).view(torch.int16), y32.to(dtype).view(torch.int16))


def test_pair_layout_is_the_documented_byte_order() -> None:
    gen = torch.Generator().manual_seed(1)
    n, k = 37, 64
    wq = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    pair = pair_layout(blocked_layout(wq, torch.ones(n, 2))[0])
    assert pair.shape == (3, k // 16, 128) and pair.dtype == torch.uint8
    u = (wq.to(torch.int16) + 8).to(torch.uint8)
    for b, c, q, i, j in [(0, 0, 0, 0, 0), (0, 1, 3, 1, 5), (1, 3, 7, 1, 7), (2, 2, 2, 0, 3)]:
        row = 16 * b + 2 * q + i
        byte = int(pair[b, c, 16 * q + 8 * i + j])
        assert byte & 0xF == int(u[row, 16 * c + j]) and byte >> 4 == int(u[row, 16 * c + 8 + j])
    pad = pair[2].view(k // 16, 8, 16)  # rows 37-47 are padding: zero weights, u4 8 in both nibbles
    assert (pad[:, 3:] == 0x88).all() and (pad[:, 2, 8:] == 0x88).all() and not (pad[:, 2, :8] == 0x88).all()


def _pretend_arm(monkeypatch: pytest.MonkeyPatch, features: set[str]) -> None:
    monkeypatch.setattr(machine, "is_arm", lambda: True)
    monkeypatch.setattr(machine, "is_x86", lambda: False)
    monkeypatch.setattr(machine, "cpu_flags", lambda *a: frozenset(features))


@pytest.mark.parametrize("features, here", [
    ({"fp", "asimd"}, []),  # Cortex-A72
    ({"fp", "asimd", "asimddp"}, ["arm.dotprod"]),  # Cortex-A76, Neoverse N1
    ({"fp", "asimd", "asimddp", "i8mm", "bf16"}, ["arm.i8mm", "arm.dotprod"]),  # Cortex-A720, Neoverse V2
])
def test_arm_routes_follow_the_cpu_features(monkeypatch: pytest.MonkeyPatch, features: set[str],
                                             here: list[str]) -> None:
    _pretend_arm(monkeypatch, features)
    arm = [r.id for r in routes.available("cpu") if r.id.startswith("arm.") and r.id != "arm.kleidiai"]
    assert arm == here
    chosen = routes.select(LinearProblem(n=576, k=2048, group_size=128), KernelPolicy())
    assert chosen.id == (here[0] if here else "cpu.portable")
    if "i8mm" not in features:
        with pytest.raises(routes.NoKernelRoute, match="lacks.*i8mm"):
            routes.select(LinearProblem(n=576, k=2048, group_size=128), KernelPolicy(route="arm.i8mm"))


def test_bit_exact_arm_routes_come_before_kleidiai() -> None:
    ids = routes.route_ids()
    assert ids.index("arm.i8mm") < ids.index("arm.dotprod") < ids.index("arm.kleidiai")
    assert routes.get("arm.i8mm").bit_exact and routes.get("arm.dotprod").bit_exact
    assert not routes.get("arm.kleidiai").bit_exact
    assert routes.get("i8mm") is routes.get("arm.i8mm") and routes.get("dotprod") is routes.get("arm.dotprod")
    assert (ArmDotprod.code, ArmI8mm.code) == (3, 4)  # csrc/cpu_common.h Isa
    if machine.is_x86():
        assert not {"dotprod", "i8mm"} & set(cpu_ext.load().cpu_isas())
        assert routes.get("arm.i8mm").unavailable() == "not an aarch64 CPU"


def test_i8mm_prepare_is_the_pair_layout_of_the_blocked_one() -> None:
    case, a = fixtures.read(fixtures.paths()[0])
    weights = CheckpointWeights(a["wq"], a["sw"], case.g, packed=False)
    weight, scales = ArmI8mm().prepare(weights, KernelPolicy())
    assert torch.equal(weight, a["pair"]) and torch.equal(scales, a["blocked_scales"])
    weight, scales = ArmDotprod().prepare(weights, KernelPolicy())
    assert torch.equal(weight, a["blocked"]) and torch.equal(scales, a["blocked_scales"])
    assert ArmI8mm().rejects(LinearProblem(n=8, k=48, group_size=48)) is not None
