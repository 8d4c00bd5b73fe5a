"""The GPU route's offline half (weight layout, route errors) and its import guard: no GPU or triton needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anychip.formats import pack_int4
from anychip.kernels.gpu import unavailable_reason
from anychip.kernels.gpu.layout import pack_nibbles, triton_layout, unpack_nibbles
from anychip.kernels.routes import NoKernelRoute
from anychip.kernels.routes.base import CheckpointWeights


def _layout(wq: torch.Tensor, scales: torch.Tensor, g: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_layout(CheckpointWeights(wq, scales, g, packed=packed))


def _q(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def test_nibbles_round_trip_every_value() -> None:
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # (3, 32): every value in both nibbles
    packed = pack_nibbles(q)
    assert packed.shape == (3, 16) and packed.dtype == torch.int8
    assert torch.equal(unpack_nibbles(packed), q)
    b = packed[0, 0].item() & 0xFF
    assert (b & 0xF, b >> 4) == (0x8, 0x9)  # w = -8 (low, k = 0) and -7 (high, k = 1), two's complement


@pytest.mark.parametrize("g", [32, 64, 128])
def test_packed_checkpoint_converts_to_the_same_layout(g: int) -> None:
    q = _q(17, 384, seed=g)
    s = torch.rand(17, 384 // g)
    w_packed, s_packed = _layout(pack_int4(q), s, g, packed=True)
    w_int8, s_int8 = _layout(q, s, g, packed=False)
    assert torch.equal(w_packed, w_int8) and torch.equal(unpack_nibbles(w_packed), q)
    assert s_packed.shape == (384 // g, 17) and torch.equal(s_packed, s.t())


@pytest.mark.parametrize("dtype,kept", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                        (torch.float32, torch.float32), (torch.float64, torch.float32)])
def test_scale_dtype(dtype: torch.dtype, kept: torch.dtype) -> None:
    _, sw = _layout(_q(4, 64), torch.rand(4, 2, dtype=dtype) + 0.01, 32, packed=False)  # scales > 0
    assert sw.dtype == kept and sw.is_contiguous()


def test_layout_errors_say_how_to_fix() -> None:
    with pytest.raises(NoKernelRoute, match="group size"):
        _layout(_q(4, 96), torch.rand(4, 1), 64, packed=False)
    with pytest.raises(NoKernelRoute, match=r"outside \[-8, 7\]"):
        _layout(torch.full((4, 64), 9, dtype=torch.int8), torch.rand(4, 2), 32, packed=False)
    with pytest.raises(NoKernelRoute, match="packed=False"):
        _layout(_q(4, 64), torch.rand(4, 2), 32, packed=True)
    with pytest.raises(NoKernelRoute, match="scales"):
        _layout(_q(4, 64), torch.rand(4, 3), 32, packed=False)


def test_cpu_tensors_are_not_for_the_triton_route() -> None:
    assert "CUDA" in unavailable_reason(torch.device("cpu"))


def test_kernels_import_and_cpu_prepare_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
        "import torch\n"
        "import anychip.kernels.ops, anychip.kernels.routes, anychip.kernels.gpu.layout\n"
        "from anychip.kernels.prepare import prepare_w4a8\n"
        "p = prepare_w4a8(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), 32, packed=False, "
        "route='reference')\n"
        "assert p.route.id == 'reference' and p.weight.device.type == 'cpu', p.route\n"
        "p = prepare_w4a8(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), 32, packed=False)\n"
        "assert p.route.device == 'cpu', p.route.id\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_tuning_shapes_of_a_config_are_vllms_merged_linears() -> None:
    from anychip.kernels.gpu.tuning import shapes_of

    config = {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 8,
              "quantization_config": {"config_groups": {"group_0": {"weights": {"group_size": 128}}}}}
    assert shapes_of(config) == [(2048, 2048, 128), (2048, 6144, 128), (4096, 2048, 128), (12288, 2048, 128)]


@pytest.mark.parametrize("table", sorted((Path(__file__).parents[1] / "anychip/kernels/gpu/tuned").glob("*.json")),
                         ids=lambda p: p.stem)
def test_shipped_tuning_tables_are_whole_and_readable(table: Path) -> None:
    """A shipped table is found by the GPU's name (gpu_slug), and a lookup that finds an entry it cannot read falls
    back to the tuner at load: so each file must sit under its GPU's slug, and every shape must have a readable
    config in every M bucket, or that GPU would tune at engine start after all."""
    import json

    pytest.importorskip("triton")  # the configs' classes live beside the kernels
    from anychip.kernels.gpu.tuning import BUCKETS, _config, slug

    doc = json.loads(table.read_text())
    assert table.stem == slug(doc["gpu"])
    shapes: dict[str, set[str]] = {}
    for key, fields in doc["entries"].items():
        bucket, _, shape = key.partition(":")
        assert _config(fields, bucket) is not None, (key, fields)
        assert all(int(v) > 0 for v in shape.split(":")) and len(shape.split(":")) == 3, key
        shapes.setdefault(shape, set()).add(bucket)
    assert shapes
    for shape, buckets in shapes.items():
        assert buckets == {str(b) for b, _ in BUCKETS}, (shape, sorted(buckets))


def test_a_damaged_tuning_cache_is_timed_again_never_fatal(tmp_path, monkeypatch, capsys) -> None:
    """The disk cache is data another program or a hand may have written: a file that is JSON of another shape,
    entries that are not objects, fields of the wrong type or value, a GEMV config for a bucket of several tokens
    are each left out with a warning (the shape is timed again); a folder that cannot be written is a warning."""
    pytest.importorskip("triton")
    import json

    from anychip.kernels.gpu import launch, tuning

    good = {"block_m": 16, "block_n": 64, "block_k": 128}
    for doc in ([1, 2], None, "x", {"entries": None}, {"entries": [good]}):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(doc))
        assert tuning._read(path) == {}
        assert "ignoring unreadable GPU tuning file" in capsys.readouterr().err
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"entries": {"mid:1:2:32": good, "512:1:2:32": "x", "decode:1:2:32": None}}))
    assert tuning._read(path) == {"mid:1:2:32": good}
    assert "ignoring 2 malformed entries" in capsys.readouterr().err
    assert tuning._config(good, "mid") == launch.GemmConfig(16, 64, 128)
    gemv = {"block_n": 64, "block_k": 128, "kind": "gemv"}
    assert tuning._config(gemv, "gemv") == launch.GemvConfig(64, 128) and tuning._config(gemv, "decode") is None
    for bad in ({"swap": "no"}, {"block_m": 16.0}, {"group_m": 0}, {"group_m": -1}, {"num_warps": 3},
                {"num_stages": 0}, {"split_k": True}, {"unknown": 1}):
        assert tuning._config({**good, **bad}, "mid") is None, bad
    assert tuning._config({**good, "kind": ["gemm"]}, "mid") is None

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    tuning._write(blocked / "some-gpu.json", torch.device("cpu"), {"mid:1:2:32": good})  # its folder is a file
    assert "could not save GPU tuning results" in capsys.readouterr().err
    monkeypatch.setenv("ANYCHIP_GPU_TUNING_DIR", str(tmp_path / "tuning"))
    from anychip import envs

    assert envs.kernel_policy().tuning_dir == tmp_path / "tuning"


def _write_entries(path: str, start: int) -> None:
    import torch

    from anychip.kernels.gpu import tuning

    torch.cuda.get_device_name = lambda device=None: "Some GPU"
    for i in range(start, start + 10):
        tuning._write(Path(path), torch.device("cpu"), {f"mid:{i}:2:32": {"block_m": 16, "block_n": 64,
                                                                          "block_k": 128}})


def test_engines_writing_the_tuning_cache_together_lose_no_entry(tmp_path) -> None:
    """Each write re-reads and merges the file under a lock: four processes' entries all survive."""
    pytest.importorskip("triton")
    import json
    import multiprocessing

    path = tmp_path / "some-gpu.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_entries, args=(str(path), 10 * i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(json.loads(path.read_text())["entries"]) == 40
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_a_tuning_candidate_that_fails_is_left_out(monkeypatch, capsys) -> None:
    """A candidate that does not compile or launch on the GPU at hand is skipped with a warning; the fastest of
    the others wins, and with none left the bucket keeps its default (None). Timed here by a stand-in clock."""
    pytest.importorskip("triton")
    from anychip.kernels.gpu import launch, timing, tuning

    options = launch.candidates(512, 256, 256, 32, 132)
    assert len(options) >= 3
    failing: set = {options[0]}
    launched: list = []

    def graph_ms(calls, replays, samples):
        calls[0]()  # the candidate's launch, which records its config
        if launched[-1] in failing:
            raise RuntimeError("out of resources: shared memory, required: 232448, hardware limit: 101376")
        return 2.0 if launched[-1] == options[1] else 1.0 + options.index(launched[-1])

    monkeypatch.setattr(timing, "graph_ms", graph_ms)
    monkeypatch.setattr(launch, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(launch, "launch_config", lambda cfg, *args: launched.append(cfg))
    w, s = torch.zeros(256, 128, dtype=torch.int8), torch.ones(8, 256, dtype=torch.bfloat16)
    times: dict = {}
    assert tuning._time_candidates(512, w, s, 256, 256, 32, times) == options[1]
    assert str(options[0]) not in times and len(times) == len(options) - 1
    assert "GPU tuning left out" in capsys.readouterr().err
    failing.update(options)
    assert tuning._time_candidates(512, w, s, 256, 256, 32) is None


def test_gpu_tuning_policy_is_checked() -> None:
    from anychip.kernels.policy import KernelPolicy

    with pytest.raises(ValueError, match="ANYCHIP_GPU_TUNE"):
        KernelPolicy(gpu_tuning="sometimes")


def test_precompile_token_counts_fall_in_their_buckets(monkeypatch) -> None:
    """The token counts precompile.py compiles a bucket's config at are in that bucket, and cover M = 1, a multiple
    of 16 and neither (Triton's specializations of an int argument); ANYCHIP_GPU_PRECOMPILE is checked."""
    pytest.importorskip("triton")
    from anychip.kernels.gpu import launch, precompile, tuning

    cpu = torch.device("cpu")
    for bucket, _ in tuning.BUCKETS:
        ms = precompile.token_counts(bucket)
        assert all(launch._key(m, 64, 256, 32, cpu)[0] == bucket for m in ms), (bucket, ms)
        if bucket != "gemv":
            assert any(m % 16 == 0 for m in ms) and any(m % 16 and m != 1 for m in ms)
    assert precompile.token_counts("gemv") == (1,)  # the GEMV takes no token count
    assert precompile.submit(64, 256, 32, cpu, ["decode"], torch.float32, 4) == 0  # not a GPU: nothing to compile
    from anychip import envs

    monkeypatch.setenv("ANYCHIP_GPU_PRECOMPILE", "0")
    assert envs.kernel_policy().gpu_precompile == 0
    monkeypatch.delenv("ANYCHIP_GPU_PRECOMPILE")
    assert envs.kernel_policy().gpu_precompile >= 1
    monkeypatch.setenv("ANYCHIP_GPU_PRECOMPILE", "many")
    with pytest.raises(ValueError, match="ANYCHIP_GPU_PRECOMPILE"):
        envs.kernel_policy()


def test_launch_arithmetic_is_tritons_and_the_untuned_default_is_the_first_candidate() -> None:
    """The launch path's plain-integer cdiv / next_pow2 agree with Triton's helpers, and a call with no settled
    config runs the regime's first candidate (built once a shape)."""
    triton = pytest.importorskip("triton")
    from anychip.kernels.gpu import launch

    for a in range(1, 5000, 7):
        assert launch.next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 3, 16, 128):
            assert launch.cdiv(a, b) == triton.cdiv(a, b)
    launch.clear_tuning()
    cpu = torch.device("cpu")
    for m in (1, 7, 64, 512, 3000):
        got = launch.serving_config(m, 576, 1536, 32, cpu)
        assert got == launch.candidates(m, 576, 1536, 32, launch.multiprocessors(cpu))[0]
        assert launch.serving_config(m, 576, 1536, 32, cpu) is got


def test_direct_launch_fills_the_signature_and_keys_like_the_jit(monkeypatch) -> None:
    """direct.py's half that needs no GPU: the arguments after the runtime ones are the constexprs in signature
    order (given, else their defaults), the specialization key separates what Triton's JIT separates, and
    ANYCHIP_DIRECT_LAUNCH=0 reaches the policy."""
    pytest.importorskip("triton", reason="triton is not installed: pip install triton (`make test` does)")
    from anychip.kernels.gpu import launch, triton_w4a8
    from anychip.kernels.gpu.direct import Direct, _spec

    cfg = launch.GemmConfig(128, 64, 128, split_k=2)
    _, args, options = launch.gemm_launch(cfg, 512, 576, 2048, 128, *[None] * 10, 2048, 576)
    tail = Direct(triton_w4a8._w4a8_gemm_kernel)._tail(args, options)
    assert tail == (128, 128, 64, 128, False, 2, 8, False, False, False, True, False, False)  # G BM BN ... FCVT, CAT
    gemv = launch.GemvConfig(64, 512, fused=True)
    _, args, options = launch.gemv_launch(gemv, 576, 2048, 128, *[None] * 10)
    tail = Direct(triton_w4a8._w4a8_gemv_kernel)._tail(args, options)
    assert tail == (128, 64, 512, 1, False, False, True, True, 2048, 1, 0, False)  # ..., AHEAD, PRE, PDL (defaults)
    _, args, options = launch.gemv_launch(gemv, 576, 2048, 128, *[None] * 10, pdl=True)
    assert Direct(triton_w4a8._w4a8_gemv_kernel)._tail(args, options)[-1] is True and options["launch_pdl"] is True
    assert Direct(triton_w4a8._w4a8_gemm_kernel)._tail(args[:5], options) is None  # a runtime argument missing
    from anychip import envs
    from anychip.kernels.gpu import direct

    monkeypatch.setenv("ANYCHIP_DIRECT_LAUNCH", "0")
    assert envs.kernel_policy().gpu_direct_launch is False
    monkeypatch.delenv("ANYCHIP_DIRECT_LAUNCH")
    assert envs.kernel_policy().gpu_direct_launch is True
    monkeypatch.setenv("ANYCHIP_GPU_PDL", "0")
    assert envs.kernel_policy().gpu_pdl is False
    monkeypatch.delenv("ANYCHIP_GPU_PDL")
    assert envs.kernel_policy().gpu_pdl is True
    assert not launch.gemv_pdl(torch.device("cpu"))  # the interpreter's tensors: never PDL
    assert "launch_pdl" not in launch.gemv_launch(gemv, 576, 2048, 128, torch.zeros(1, 2048), *[None] * 9)[2]
    monkeypatch.setitem(direct._SETTINGS, "enabled", True)
    direct.set_enabled(False)
    assert direct._launcher_api() is None  # every launch through the JIT
    direct.set_enabled(True)
    assert direct._launcher_api() is not None  # and back: nothing remembers the switch's earlier state
    x = torch.zeros(40, dtype=torch.bfloat16)
    assert _spec(x) != _spec(x[1:]) and _spec(x) != _spec(x.float()) and _spec(x) == _spec(x[8:])
    assert len({_spec(v) for v in (1, 16, 17, 32, 2**31)}) == 4 and _spec(16) == _spec(32)
    assert _spec(None) is None and _spec(1e-5) is float


def test_streaming_split_gives_each_program_two_steps_and_splits_past_the_wave_cutoff() -> None:
    """The decode rows flagged "s" split K by split_for's streaming rule (the sweep of docs/gpu-notes.md, session
    35): about per_sm programs a multiprocessor, each at least two K steps, also where the plain rule gives up."""
    pytest.importorskip("triton", reason="triton is not installed: pip install triton (`make test` does)")
    from anychip.kernels.gpu import launch

    args = (16, 32, 256, 4, 132)  # block_m, block_n, block_k, per_sm, multiprocessors
    assert launch.split_for(16, 14336, 4096, 128, *args) == 1  # 448 tiles: the plain rule stops at half a wave
    assert launch.split_for(16, 14336, 4096, 128, *args, streaming=True) == 2
    assert launch.split_for(16, 3072, 2048, 128, *args, streaming=True) == 4  # 8 steps: at most 4 splits
    assert launch.split_for(16, 2048, 8192, 128, *args, streaming=True) == 9  # cdiv(528, 64 tiles)
    assert launch.split_for(16, 65536, 4096, 128, *args, streaming=True) == 1  # 2048 tiles fill the GPU
    assert launch.split_for(16, 4096, 256, 128, *args, streaming=True) == 1  # one step: nothing to split
    streaming = [c for c in launch.candidates(16, 14336, 4096, 128, 132) if c.block_k == 256 and c.split_k == 2]
    assert len(streaming) == 2 and {c.block_n for c in streaming} == {32, 64}


def test_gluon_gemm_candidates_table_entries_and_policy(monkeypatch) -> None:
    """The Gluon GEMM's tiles are timed only for prefill, only when asked (the policy's gpu_wgmma, off by default)
    and only where the shape fits them (G 64 or 128); never the untuned default; a table entry names them with
    "kind": "wgmma" and reads back as the same config."""
    pytest.importorskip("triton")
    from anychip import envs
    from anychip.kernels.gpu import launch, tuning
    from anychip.kernels.gpu.gluon_w4a8 import WgmmaConfig

    def kinds(m: int, g: int, wgmma: bool) -> set[type]:
        return {type(c) for c in launch.candidates(m, 4096, 2048, g, 132, wgmma)}

    if launch.gw.gluon is not None:
        assert WgmmaConfig in kinds(512, 128, True) and WgmmaConfig in kinds(4096, 64, True)
        assert not isinstance(launch.candidates(512, 4096, 2048, 128, 132, True)[0], WgmmaConfig)
    assert WgmmaConfig not in kinds(512, 128, False) | kinds(64, 128, True) | kinds(16, 128, True)
    assert WgmmaConfig not in kinds(512, 32, True)  # G32: the Gluon GEMM's groups are 64 or 128 columns
    assert not launch.wgmma_capable(torch.device("cpu"))
    cfg = WgmmaConfig(64, 128, 8, 3, unroll=4)
    fields = tuning._fields(cfg)
    assert fields["kind"] == "wgmma" and tuning._config(fields) == cfg
    with pytest.raises(ValueError, match="unroll"):
        WgmmaConfig(unroll=3)
    monkeypatch.delenv("ANYCHIP_GPU_WGMMA", raising=False)
    assert envs.kernel_policy().gpu_wgmma is False
    monkeypatch.setenv("ANYCHIP_GPU_WGMMA", "1")
    assert envs.kernel_policy().gpu_wgmma is True
