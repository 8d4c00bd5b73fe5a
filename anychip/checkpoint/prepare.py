"""`anychip prepare`: the embedded default model (SmolLM2-135M-Instruct GGUF) -> BF16 -> verified W4A8.

    <cache>/smollm2-135m-instruct/bf16               dequantized from the GGUF, with tokenizer and chat template
    <cache>/smollm2-135m-instruct/w4a8-g64-rtn       the W4A8 checkpoint `anychip serve` runs

Each step is skipped when its directory was built by the same recipe and still verifies. `--synthetic` builds
a random-weight checkpoint instead (see synthetic.py).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from anychip.checkpoint.cache import cache_lock, clear_done, is_done, mark_done
from anychip.checkpoint.default_bf16 import bf16_step, log
from anychip.checkpoint.from_gguf import find_default_gguf, model_slug
from anychip.checkpoint.gptq import DEFAULT_GPTQ, GPTQConfig
from anychip.checkpoint.manifest import sha256_file
from anychip.checkpoint.quantize import METHODS, choose_group_size, make_quantizer, quantize_checkpoint
from anychip.checkpoint.scheme import FORMATS, GROUP_SIZES, ContractError, Format, W4A8Scheme
from anychip.checkpoint.synthetic import make_synthetic, parse_shape
from anychip.checkpoint.verify import VerifyReport, verify_checkpoint
from anychip.envs import cache_dir


@dataclass(frozen=True)
class PrepareRecipe:
    """How `prepare` quantizes the default model. The one place to change when another method measures better.

    method: a quantize method ("rtn" or "gptq").
    format: the compressed-tensors format of the INT4 weights.
    group_size: None picks the largest supported group size that divides K of every decoder linear.
    gptq_samples: calibration sequences (of 512 tokens) when method is "gptq".
    gptq: the rest of the GPTQ recipe (act-order, scales, smoothing; part of the cache key, so a new recipe
        rebuilds the cached checkpoint).

    GPTQ at group size 32 measured best on SmolLM2-135M (docs/bench/accuracy.md); 32 calibration sequences scored
    the same as 128 there at a quarter of the CPU time.
    """

    method: str = "gptq"
    format: Format = "pack-quantized"
    group_size: int | None = 32
    gptq_samples: int = 32
    gptq: GPTQConfig = DEFAULT_GPTQ

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ContractError(f"prepare method {self.method!r}: use one of {METHODS}")
        if self.format not in FORMATS:
            raise ContractError(f"prepare format {self.format!r}: use one of {FORMATS}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ContractError(f"prepare group size {self.group_size}: use one of {GROUP_SIZES} or None")
        if self.gptq_samples < 1:
            raise ContractError(f"prepare gptq_samples {self.gptq_samples}: must be at least 1")


DEFAULT_RECIPE = PrepareRecipe()


@dataclass(frozen=True)
class PreparedModel:
    """The prepared default model: its BF16 source, its verified W4A8 checkpoint, and whether both were reused."""

    name: str
    bf16_dir: Path
    w4a8_dir: Path
    report: VerifyReport
    reused: bool


def prepare_default(cache: Path | None = None, force: bool = False,
                    recipe: PrepareRecipe = DEFAULT_RECIPE) -> PreparedModel:
    """GGUF -> BF16 -> W4A8 in `cache` (default: $ANYCHIP_CACHE or ~/.cache/anychip/models), reusing verified work."""
    gguf = find_default_gguf()
    root = (cache or cache_dir()).expanduser().absolute() / model_slug(gguf)
    with cache_lock(root):
        bf16, bf16_reused = bf16_step(gguf, root, force)
        group = recipe.group_size or choose_group_size(bf16)
        scheme = W4A8Scheme(group_size=group, format=recipe.format)
        suffix = "" if recipe.format == "pack-quantized" else "-int"
        w4a8 = root / f"w4a8-g{group}-{recipe.method}{suffix}"
        step = {"step": "w4a8", **asdict(recipe), "gptq": recipe.gptq.recipe(), "group_size": group,
                "bf16_manifest_sha256": sha256_file(bf16 / "SHA256SUMS")}
        reports: list[VerifyReport] = []
        reused = not force and is_done(w4a8, step, lambda d: reports.append(verify_checkpoint(d)))
        if reused:
            log(f"reusing {w4a8}")
        else:
            log(f"quantizing to W4A8 ({recipe.method}, group size {group}) in {w4a8}")
            clear_done(w4a8)
            options = {"samples": recipe.gptq_samples, "config": recipe.gptq} if recipe.method == "gptq" else {}
            quantizer = make_quantizer(recipe.method, bf16, scheme, **options)
            quantize_checkpoint(bf16, w4a8, scheme, quantizer, method=recipe.method, overwrite=True)
            reports.append(verify_checkpoint(w4a8))
            mark_done(w4a8, step)
        report = reports[-1]
    return PreparedModel(name=root.name, bf16_dir=bf16, w4a8_dir=w4a8, report=report,
                         reused=bf16_reused and reused)


def cmd_prepare(args: argparse.Namespace) -> int:
    cache = Path(args.cache) if args.cache else None
    if args.synthetic:
        tokenizer = Path(args.tokenizer) if args.tokenizer else None
        report = make_synthetic(parse_shape(args.synthetic), cache=cache, force=args.force, tokenizer=tokenizer)
        print(report.summary())
        print(report.path)
        return 0
    if args.tokenizer:
        raise ContractError("--tokenizer goes with --synthetic: the default model brings its own")
    prepared = prepare_default(cache=cache, force=args.force)
    print(prepared.report.summary())
    print(prepared.w4a8_dir)
    return 0
