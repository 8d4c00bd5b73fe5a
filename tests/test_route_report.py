"""`anychip routes`: every route with availability and reason, and the strict-mode route of each linear."""

from __future__ import annotations

import json

import pytest

from anychip.checkpoint.quantize import quantize_checkpoint
from anychip.checkpoint.scheme import W4A8Scheme
from anychip.cli import main
from anychip.kernels import routes


@pytest.fixture(scope="module")
def w4a8(tiny_llama, tmp_path_factory):
    return quantize_checkpoint(tiny_llama(), tmp_path_factory.mktemp("routes") / "w4a8", W4A8Scheme(group_size=32))


def _json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["routes", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_routes_lists_every_route_with_a_reason(capsys, monkeypatch):
    monkeypatch.delenv("ANYCHIP_KERNEL_ISA", raising=False)
    rc, doc = _json(capsys)
    assert rc == 0 and set(doc) == {"machine", "routes", "head_routes", "head"}
    assert doc["head"]["kind"] == "bf16" and doc["head"]["route"].startswith("cpu.head_bf16.")
    assert {r["id"] for r in doc["head_routes"] if r["available"]} >= {doc["head"]["route"]}
    assert [r["id"] for r in doc["routes"]] == list(routes.route_ids())
    for r in doc["routes"]:
        assert set(r) >= {"id", "device", "available", "reason", "bit_exact"}
        assert (r["reason"] is None) == r["available"]
    by = {r["id"]: r for r in doc["routes"]}
    assert by["arm.kleidiai"]["bit_exact"] is False and by["cpu.portable"]["available"]
    if not by["cuda.triton"]["available"]:
        assert by["cuda.triton"]["reason"]


def test_routes_for_a_model_follow_strict_selection(capsys, monkeypatch, w4a8):
    monkeypatch.delenv("ANYCHIP_KERNEL_ISA", raising=False)
    rc, doc = _json(capsys, str(w4a8))
    best = routes.available("cpu")[0].id
    assert rc == 0 and doc["model"]["kind"] == "w4a8" and doc["model"]["contract"] is None
    assert len(doc["layers"]) == 2 * 7  # tiny: 2 layers, 7 linears each as the checkpoint stores them
    assert {layer["route"] for layer in doc["layers"]} == {best}
    assert doc["layers"][0]["name"].startswith("model.layers.") and doc["layers"][0]["group_size"] == 32
    # a forced route that cannot run here: every layer says why, and the command fails
    unavailable = next((r.id for r in routes.preferred("cpu") if r.unavailable()), None)
    if unavailable is None:
        pytest.skip("every CPU route runs on this machine")
    monkeypatch.setenv("ANYCHIP_KERNEL_ISA", unavailable)
    rc, doc = _json(capsys, str(w4a8))
    assert rc == 1 and all(layer["route"] is None and "not available" in layer["reason"] for layer in doc["layers"])
    rc = main(["routes", str(w4a8)])
    assert rc == 1 and "no route" in capsys.readouterr().out


def test_routes_say_strict_mode_refuses_a_forced_reference_and_a_typo_is_an_error(capsys, monkeypatch, w4a8):
    """ANYCHIP_KERNEL_ISA=reference: the engine refuses it in strict mode, so `routes MODEL` says so (it listed
    every linear on the reference and exited 0); a route name no route has is an error even with fallback allowed
    (it ran every linear on the reference, silently); spaces around the name are dropped."""
    from anychip.kernels.policy import KernelPolicy
    from anychip.kernels.routes import LinearProblem, NoKernelRoute

    monkeypatch.setenv("ANYCHIP_KERNEL_ISA", "reference")
    rc, doc = _json(capsys, str(w4a8))
    assert rc == 1 and all(layer["route"] is None and "strict mode refuses" in layer["reason"]
                           for layer in doc["layers"])
    problem = LinearProblem(64, 64, 32, "cpu")
    with pytest.raises(NoKernelRoute, match="unknown kernel route 'bogus'"):
        routes.select(problem, KernelPolicy(route="bogus", allow_fallback=True))
    monkeypatch.setenv("ANYCHIP_KERNEL_ISA", "  portable ")
    from anychip import envs

    assert envs.forced_isa() == "portable"


def test_routes_cuda_device_without_a_gpu(capsys, monkeypatch, w4a8):
    monkeypatch.delenv("ANYCHIP_KERNEL_ISA", raising=False)
    if routes.get("cuda.triton").unavailable() is None:
        pytest.skip("this machine has a GPU")
    rc, doc = _json(capsys, str(w4a8), "--device", "cuda")
    assert rc == 1 and all("no CUDA device" in layer["reason"] for layer in doc["layers"])


def test_routes_say_when_the_checkpoint_contract_refuses_what_the_headers_show(capsys, monkeypatch, w4a8, tmp_path):
    """Routes exist for every linear, but config.json declares G64 over G32 scales: the engine would refuse it, so
    `routes MODEL` says so and fails instead of listing routes as if it would serve."""
    import shutil

    monkeypatch.delenv("ANYCHIP_KERNEL_ISA", raising=False)
    d = shutil.copytree(w4a8, tmp_path / "g64-declared")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    (d / "config.json").write_text(json.dumps(config))
    rc, doc = _json(capsys, str(d))
    assert rc == 1 and "group size" in doc["model"]["contract"]
    assert main(["routes", str(d)]) == 1
    assert "checkpoint contract (headers and config; checksums and values: `anychip verify`): REFUSED" in \
        capsys.readouterr().out
