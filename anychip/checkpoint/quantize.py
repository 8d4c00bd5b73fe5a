"""`anychip quantize SRC DST`: a BF16 decoder directory (Llama, Mistral, Qwen2, Qwen3, Granite, Gemma 1-3) -> a
compressed-tensors directory, tensor by tensor.

The pipeline (read a source tensor, quantize it, write it) is shared by every method: a method only supplies a
`WeightQuantizer`, called once per decoder linear, in layer order (layer 0's q, k, v, o, gate, up, down first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from anychip import __version__
from anychip.checkpoint.io import (
    MAX_SHARD_BYTES,
    MISTRAL_NOTE,
    ShardedWriter,
    TensorInfo,
    atomic_directory,
    copy_side_files,
    is_mistral_format,
    not_carried,
    read_tensor_infos,
)
from anychip.checkpoint.layout import (
    DecoderDims,
    TensorSpec,
    check_architecture,
    group_size_error,
    linear_prefix,
    linear_tensor_specs,
    parse_linear_weight,
    tensor_order,
)
from anychip.checkpoint.manifest import write_manifest
from anychip.checkpoint.model_dir import ModelDir, weight_files_stamp
from anychip.checkpoint.rtn import rtn_quantize
from anychip.checkpoint.scheme import DECODER_LINEARS, ContractError, W4A8Scheme
from anychip.checkpoint.values import SCALE
from anychip.errors import AnychipError
from anychip.formats import GROUP_SIZES, pack_int4

#: (linear prefix, BF16 weight (N, K)) -> (wq (N, K) int8 in [-8, 7], scales (N, K // G)). Scales are stored
#: BF16: a quantizer should compute q against BF16-rounded scales so that q * scale is what readers see.
#: A quantizer may also carry `replaced` ({tensor name: BF16 tensor} written instead of the source's, e.g.
#: RMSNorm weights with smoothing folded in) and `recipe` (a JSON-able dict recorded in the provenance).
WeightQuantizer = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

METHODS: tuple[str, ...] = ("rtn", "gptq")
_SKIPPED = (".rotary_emb.inv_freq",)  # recomputed by every runtime; older checkpoints store it


def rtn_quantizer(scheme: W4A8Scheme) -> WeightQuantizer:
    """Round-to-nearest per-group quantization (no calibration)."""
    return lambda prefix, w: rtn_quantize(w, scheme.group_size, name=prefix)


def make_quantizer(method: str, src: Path, scheme: W4A8Scheme, **options: Any) -> WeightQuantizer:
    """The quantizer for `method`; `options` go to GPTQ (calibration, samples, seq_len, damp, refit, tune_steps,
    asymmetric, e2e_steps, config)."""
    if method == "rtn":
        return rtn_quantizer(scheme)
    if method == "gptq":
        try:
            from anychip.checkpoint.gptq import gptq_quantizer
        except ModuleNotFoundError as exc:
            if exc.name != "anychip.checkpoint.gptq":
                raise
            raise AnychipError("--method gptq: anychip.checkpoint.gptq is not part of this build; use --method rtn")
        return gptq_quantizer(src, scheme, **options)
    raise AnychipError(f"--method {method!r} is not known: use one of {', '.join(METHODS)}")


def check_source(src: Path, scheme: W4A8Scheme) -> tuple[dict[str, Any], list[tuple[TensorInfo, list[TensorSpec]]]]:
    """Check that `src` is a BF16 decoder of a supported family that `scheme` can quantize (headers only,
    cheap); returns its config and the write plan. Raises ContractError naming the first layer whose K the group
    size does not divide."""
    config = ModelDir.open(src).config
    check_architecture(config, f"{src}/config.json")
    dims = DecoderDims.from_config(config, f"{src}/config.json")  # the family's refusals (e.g. Qwen3 with biases)
    if qc := config.get("quantization_config"):
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ContractError(f"{src} is already quantized ({method}): quantize from the BF16 model")
    infos = read_tensor_infos(src)
    _check_not_quantized(src, infos)
    _check_linears_present(src, infos, dims.layers)
    plan = _plan(infos, scheme)
    from anychip.checkpoint.verify import check_tokenizer

    check_tokenizer(src, dims.vocab, "the quantized model needs the tokenizer its weights were trained with; put "
                                     "its tokenizer files in the source folder")
    return config, plan


def _check_linears_present(src: Path, infos: dict[str, TensorInfo], layers: int) -> None:
    """Every decoder linear the config implies is in the weights, under the family's own name: a checkpoint
    with fused projections (Phi-3's qkv_proj / gate_up_proj) relabelled as another architecture is refused here,
    before any work, naming what its weights hold instead."""
    for i in range(layers):
        missing = [name for name in DECODER_LINEARS if f"{linear_prefix(i, name)}.weight" not in infos]
        if missing:
            held = sorted(n.removeprefix(f"model.layers.{i}.") for n in infos if n.startswith(f"model.layers.{i}."))
            raise ContractError(f"{src}: config.json declares {layers} decoder layers with separate "
                                f"{', '.join(DECODER_LINEARS)}, but layer {i}'s weights have no "
                                f"{', '.join(missing)} (they hold {', '.join(held) or 'nothing'}): these weights "
                                "are not of the architecture config.json names")


def linear_ks(src: Path) -> dict[str, int]:
    """{linear prefix: K} for every decoder linear of a BF16 directory (headers only)."""
    out = {}
    for name, info in read_tensor_infos(src).items():
        parsed = parse_linear_weight(name)
        if parsed:
            out[name.removesuffix(".weight")] = info.shape[1]
    return out


def choose_group_size(src: Path) -> int:
    """The largest supported group size that divides K of every decoder linear of `src`."""
    ks = linear_ks(src)
    if not ks:
        raise ContractError(f"{src}: no decoder linears (model.layers.N.*_proj.weight) found")
    for g in sorted(GROUP_SIZES, reverse=True):
        if all(k % g == 0 for k in ks.values()):
            return g
    prefix, k = next((p, k) for p, k in ks.items() if k % min(GROUP_SIZES))
    raise group_size_error(prefix, k, min(GROUP_SIZES))


#: Tensor names only a quantized checkpoint holds (compressed-tensors, GPTQ / AWQ, FP8 and bitsandbytes layouts).
_QUANTIZED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
                       ".qweight", ".qzeros", ".scales", ".g_idx", ".input_scale", ".weight_scale_inv", ".SCB")


def _check_not_quantized(src: Path, infos: dict[str, TensorInfo]) -> None:
    """A source whose config lost its quantization_config can still hold quantized tensors: named before any
    work, where they crashed the writer or were quantized again before the final verify refused them."""
    for name, info in infos.items():
        low_bits = parse_linear_weight(name) and (info.torch_dtype is None or not info.torch_dtype.is_floating_point
                                                  or info.torch_dtype.itemsize == 1)
        if name.endswith(_QUANTIZED_SUFFIXES) or low_bits:
            raise ContractError(f"{src} holds quantized weights ({name}, {info.dtype}) though its config.json has no "
                                "quantization_config: quantize from the unquantized BF16, FP16 or FP32 model")


def _plan(infos: dict[str, TensorInfo], scheme: W4A8Scheme) -> list[tuple[TensorInfo, list[TensorSpec]]]:
    """Per source tensor (in write order), the output tensors it becomes. Fails before anything is written."""
    plan = []
    for name in sorted(infos, key=tensor_order):
        info = infos[name]
        if name.endswith(_SKIPPED):
            continue
        if parse_linear_weight(name):
            if len(info.shape) != 2:
                raise ContractError(f"{name}: expected a 2-D weight, got shape {list(info.shape)}")
            n, k = info.shape
            plan.append((info, linear_tensor_specs(name.removesuffix(".weight"), n, k, scheme)))
        else:
            dtype = info.torch_dtype
            if dtype is None or not dtype.is_floating_point:
                raise ContractError(f"{info.file}: {name} is {info.dtype}, where a BF16, FP16 or FP32 decoder's "
                                    "tensors are floating point: quantize from the unquantized model")
            plan.append((info, [TensorSpec(name, torch.bfloat16, info.shape)]))
    return plan


def _quantized_tensors(prefix: str, w: torch.Tensor, quantizer: WeightQuantizer,
                       scheme: W4A8Scheme) -> list[torch.Tensor]:
    n, k = w.shape
    if not (finite := torch.isfinite(w)).all():  # the quantizers would give its group scale 1 and codes 0: silently
        bad = (~finite).nonzero()[0].tolist()
        raise AnychipError(f"{prefix}.weight of the source holds {w[bad[0], bad[1]].item()} at {bad}: the BF16 source "
                           "is damaged; re-create or re-download it")
    wq, scales = quantizer(prefix, w)
    groups = k // scheme.group_size
    if wq.dtype != torch.int8 or tuple(wq.shape) != (n, k):
        raise AnychipError(f"{prefix}: quantizer returned wq {wq.dtype} {list(wq.shape)}, expected int8 [{n}, {k}]")
    if tuple(scales.shape) != (n, groups):
        raise AnychipError(f"{prefix}: quantizer returned scales {list(scales.shape)}, expected [{n}, {groups}]")
    scales = scales.to(torch.bfloat16)
    if SCALE.any_bad(scales):  # the contract's rule (values.py), as `anychip verify` applies it
        row, group = SCALE.bad(scales).nonzero()[0].tolist()
        amax = w[row, group * scheme.group_size:(group + 1) * scheme.group_size].float().abs().max().item()
        raise AnychipError(f"{prefix}: quantizer returned group scale {scales[row, group].item():.4g} at [{row}, "
                           f"{group}], where the weights' largest magnitude is {amax:.4g}: {SCALE.what}")
    if scheme.format == "pack-quantized":
        return [pack_int4(wq), scales, torch.tensor([n, k], dtype=torch.int64)]
    if int(wq.min()) < -8 or int(wq.max()) > 7:
        raise AnychipError(f"{prefix}: quantizer returned values outside the int4 range [-8, 7]")
    return [wq, scales]


def quantize_checkpoint(src: Path, dst: Path, scheme: W4A8Scheme, quantizer: WeightQuantizer | None = None,
                        method: str = "rtn", *, overwrite: bool = False,
                        max_shard_bytes: int = MAX_SHARD_BYTES, provenance: dict[str, Any] | None = None) -> Path:
    """Quantize the BF16 decoder directory `src` into the W4A8 directory `dst` (written atomically, with
    SHA256SUMS, contract-verified before it appears). `quantizer` defaults to RTN; `method` is recorded as
    provenance, and `provenance` adds to (or overrides) what is recorded, e.g. the source a rotated `src` was
    made from. Returns `dst`."""
    from anychip.checkpoint.verify import verify_checkpoint

    src, dst = Path(src).resolve(), Path(dst).absolute()
    config, plan = check_source(src, scheme)
    quantizer = quantizer or rtn_quantizer(scheme)
    specs = [spec for _, outs in plan for spec in outs]
    recorded = {"source": str(src), "source_files": weight_files_stamp(src), "method": method,
                "group_size": scheme.group_size, "format": scheme.format, "anychip_version": __version__}
    recipe = getattr(quantizer, "recipe", None)
    if recipe is not None:
        recorded["recipe"] = recipe
    recorded.update(provenance or {})
    replaced: dict[str, torch.Tensor] = dict(getattr(quantizer, "replaced", None) or {})
    _check_replaced(replaced, plan)
    with atomic_directory(dst, overwrite=overwrite) as tmp, ExitStack() as stack:
        handles: dict[Path, Any] = {}
        with ShardedWriter(tmp, specs, max_shard_bytes) as writer:
            for info, outs in tqdm(plan, desc=f"quantize {method} g{scheme.group_size}", unit="tensor"):
                if info.file not in handles:
                    handles[info.file] = stack.enter_context(safe_open(str(info.file), framework="pt"))
                t = handles[info.file].get_tensor(info.name)
                if len(outs) == 1 and outs[0].name == info.name:
                    tensors = [replaced.pop(info.name, t).to(outs[0].dtype)]
                else:
                    tensors = _quantized_tensors(info.name.removesuffix(".weight"), t.to(torch.bfloat16),
                                                 quantizer, scheme)
                for spec, tensor in zip(outs, tensors):
                    writer.write(spec.name, tensor)
                del t, tensors
        config = dict(config, quantization_config=scheme.quantization_config(source=recorded))
        for key in DTYPE_KEYS:  # every float tensor is BF16 now, and vLLM refuses other dtypes for the scheme
            if key in config or key == DTYPE_KEYS[0]:
                config[key] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(src, tmp)
        if left := not_carried(src):
            print(f"anychip quantize: not carried into {dst.name} (only top-level tokenizer, chat and generation "
                  f"files are): {', '.join(left)}", file=sys.stderr)
        if is_mistral_format(src):
            print(f"anychip quantize: note: {MISTRAL_NOTE.format(src=src.name)}", file=sys.stderr)
        write_manifest(tmp)
        verify_checkpoint(tmp, checksums=False)
    return dst


#: config.json's dtype entries: transformers' older name (read by every version), and the one transformers 5 writes.
DTYPE_KEYS = ("torch_dtype", "dtype")


def _check_replaced(replaced: dict[str, torch.Tensor], plan: list[tuple[TensorInfo, list[TensorSpec]]]) -> None:
    """Every tensor a quantizer replaces is a BF16 tensor of the plan, with the source's shape."""
    dense = {outs[0].name: outs[0] for _, outs in plan if len(outs) == 1}
    for name, t in replaced.items():
        spec = dense.get(name)
        if spec is None or tuple(t.shape) != tuple(spec.shape):
            want = "no such unquantized tensor" if spec is None else f"the source has shape {list(spec.shape)}"
            raise AnychipError(f"the quantizer replaces {name} with shape {list(t.shape)}, but {want}: "
                               "it was calibrated on another model")


def check_destination(dst: Path) -> None:
    """`dst` does not exist and a folder can be made beside it (where atomic_directory will fill one): checked by
    making and removing one in the nearest existing parent, so that a read-only file system, a file on the path or
    a pseudo file system is named now, not after calibration."""
    import tempfile

    dst = dst.absolute()
    if dst.exists() or dst.is_symlink():
        raise AnychipError(f"{dst} already exists: remove it or choose another output directory")
    parent = dst.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise AnychipError(f"{dst}: {parent} is a file, not a folder: choose another output directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{dst.name}.probe-", dir=parent))
    except OSError as exc:
        raise AnychipError(f"{dst}: cannot create a folder in {parent} ({exc.strerror or exc}): choose another "
                           "output directory") from None


def cmd_quantize(args: argparse.Namespace) -> int:
    from anychip.checkpoint.verify import verify_checkpoint

    src, dst = Path(args.src), Path(args.dst)
    scheme = W4A8Scheme(group_size=args.group_size, format=args.format)
    # Fail on a bad destination or group size before GPTQ spends minutes calibrating.
    check_destination(dst)
    check_source(src, scheme)
    options = {}
    gptq_only = {"--calibration": args.calibration, "--samples": args.samples, "--seq-len": args.seq_len,
                 "--damp": args.damp, "--refit": args.refit}
    given = [f"{flag} {value}" for flag, value in gptq_only.items() if value is not None]
    if given and args.method != "gptq":
        raise AnychipError(f"{', '.join(given)}: GPTQ's calibration settings, which --method {args.method} would "
                           "ignore: add --method gptq, or leave them out")
    if args.tune_steps is not None and args.method != "gptq":
        raise AnychipError(f"--tune-steps {args.tune_steps} tunes GPTQ's result: add --method gptq")
    if args.e2e_steps is not None and args.method != "gptq":
        raise AnychipError(f"--e2e-steps {args.e2e_steps} tunes GPTQ's scales: add --method gptq")
    if args.asymmetric and args.method != "gptq":
        raise AnychipError("--asymmetric is a way of calibrating GPTQ: add --method gptq")
    if args.method == "gptq":
        options = dict(calibration=args.calibration, samples=args.samples, seq_len=args.seq_len, damp=args.damp,
                       refit=args.refit, tune_steps=args.tune_steps, asymmetric=args.asymmetric or None,
                       e2e_steps=args.e2e_steps)
    if args.rotate is None:
        quantizer = make_quantizer(args.method, src, scheme, **options)
        out = quantize_checkpoint(src, dst, scheme, quantizer, method=args.method)
    else:
        out = _quantize_rotated(src, dst, scheme, args.method, args.rotate, options)
    print(verify_checkpoint(out).summary())
    print(out)
    return 0


def _quantize_rotated(src: Path, dst: Path, scheme: W4A8Scheme, method: str, seed: int,
                      options: dict[str, Any]) -> Path:
    """`anychip quantize --rotate SEED`: rotate `src` (rotate.py) into a folder beside `dst`, quantize that, record
    the rotation and the original source, and remove the folder. GPTQ runs without smoothing: after a rotation it
    cost perplexity on the default model (docs/bench/accuracy.md, "Residual rotation")."""
    import tempfile
    from dataclasses import replace

    from anychip.checkpoint.rotate import rotate_llama

    dst.absolute().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dst.name}.rotated-", dir=dst.absolute().parent) as tmp:
        rotated = rotate_llama(src, Path(tmp) / "bf16", seed=seed)
        if method == "gptq":
            from anychip.checkpoint.gptq import DEFAULT_GPTQ

            options = dict(options, config=replace(DEFAULT_GPTQ, smooth=()))
        quantizer = make_quantizer(method, rotated, scheme, **options)
        rotation = {"seed": seed, "matrix": "diag(random signs) (Hadamard(2^a) x random orthogonal(b)), "
                                            "hidden = 2^a * b (anychip/checkpoint/rotate.py)",
                    "bf16_changed": "embedding, every RMSNorm weight (now ones), every linear and the head (now "
                                    "untied) are rotated: the BF16 tensors differ from the source's; the function "
                                    "is the source's up to their BF16 rounding"}
        return quantize_checkpoint(rotated, dst, scheme, quantizer, method=method,
                                   provenance={"source": str(Path(src).resolve()),
                                               "source_files": weight_files_stamp(Path(src).resolve()),
                                               "rotation": rotation})
