"""`anychip verify DIR`: checksums, the W4A8 checkpoint contract from the safetensors headers, then the values.

The contract: a decoder with Llama's linears (layout.FAMILIES: Llama, Mistral, Qwen2, Qwen3, Granite, Gemma 1-3) whose
linear is stored exactly as `layout.linear_tensor_specs` says for the declared scheme; embedding, norms, the
biases the family has (and lm_head if present) BF16; config, tokenizer and weights of one model; a
quantization_config that targets every Linear and ignores only lm_head. The value pass (values.py; skipped by
`--fast`) then reads every scale, INT8-stored weight and BF16 tensor. The first violation
raises ContractError (or ManifestError / CheckpointFileError) naming the file, and the tensor where there is one.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anychip.checkpoint.io import ST_CODES, TensorInfo, read_tensor, read_tensor_infos
from anychip.checkpoint.layout import (
    DecoderDims,
    TensorSpec,
    bf16_tensor_specs,
    check_architecture,
    linear_prefix,
    linear_tensor_specs,
)
from anychip.checkpoint.manifest import MANIFEST, ManifestError, check_manifest, listed_files, write_manifest
from anychip.checkpoint.model_dir import ModelDir
from anychip.checkpoint.scheme import DECODER_LINEARS, IGNORED, ContractError, W4A8Scheme, scheme_from_config
from anychip.checkpoint.values import check_values, rule_for
from anychip.errors import AnychipError


@dataclass
class VerifyReport:
    """What `verify_checkpoint` found; `summary()` is the one-screen text `anychip verify` prints."""

    path: Path
    architecture: str
    dims: DecoderDims
    scheme: W4A8Scheme
    tokenizer_size: int | None
    linears_by_group_size: dict[int, int]
    bytes_by_dtype: dict[str, int]
    total_bytes: int
    files: int
    checksums_verified: bool
    provenance: dict[str, Any] = field(default_factory=dict)
    synthetic: dict[str, Any] | None = None
    value_bytes: int | None = None  # bytes the value pass read; None when it was skipped

    @property
    def num_layers(self) -> int:
        return self.dims.layers

    @property
    def group_size(self) -> int:
        return self.scheme.group_size

    @property
    def format(self) -> str:
        return self.scheme.format

    @property
    def num_linears(self) -> int:
        return sum(self.linears_by_group_size.values())

    def one_line(self) -> str:
        """The line serve, eval and bench print once the checkpoint they are about to run is verified."""
        return (f"verified  {self.path}: {self.num_layers} layers, {self.num_linears} W4A8 linears G{self.group_size} "
                f"{self.format}, {self.total_bytes / 1e6:.0f} MB, checksums OK, "
                + ("values OK" if self.value_bytes is not None else "values not checked (--verify fast)"))

    def summary(self) -> str:
        d = self.dims
        lines = [
            f"W4A8 checkpoint  {self.path}",
            f"model            {self.architecture}  hidden {d.hidden}  intermediate {d.intermediate}  "
            f"heads {d.heads} (kv {d.kv_heads}) x {d.head_dim}  vocab {d.vocab}"
            + (f" (tokenizer {self.tokenizer_size})" if self.tokenizer_size else "")
            + ("  tied embeddings" if d.tied else ""),
            f"layers           {d.layers}",
            f"linears          {self.num_linears} INT4: "
            + ", ".join(f"{n} at G{g}" for g, n in sorted(self.linears_by_group_size.items()))
            + f"  format {self.format}",
        ]
        if self.synthetic is not None:
            lines.append("SYNTHETIC        random weights, NOT A MODEL: throughput measurements only")
        if self.provenance:
            p = self.provenance
            lines.append(f"source           {p.get('method', '?')} from {p.get('source', '?')} "
                         f"(anychip {p.get('anychip_version', '?')})")
        lines.append("bytes by dtype   " + "  ".join(f"{k} {_mb(v)}" for k, v in sorted(self.bytes_by_dtype.items())))
        lines.append(f"total            {_mb(self.total_bytes)} in {self.files} files; "
                     + ("every sha256 matches SHA256SUMS" if self.checksums_verified else "checksums not checked"))
        lines.append("values           " + ("not checked (--fast)" if self.value_bytes is None else
                                            f"scales normal, > 0 and 8 s finite, INT4 in range, BF16 finite "
                                            f"({_mb(self.value_bytes)} read)"))
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"


def tokenizer_size(directory: Path) -> int | None:
    """Token ids the tokenizer can produce (max id + 1) from tokenizer.json; None without one."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ContractError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from exc
    return tokenizer_json_size(tok, path)


def check_tokenizer(path: Path, vocab: int, fix: str) -> int | None:
    """The model directory `path` has a tokenizer whose ids fit its `vocab` rows (ContractError, ending with
    `fix`, otherwise); returns tokenizer_size."""
    tok = tokenizer_size(path)
    if tok is None and not (path / "tokenizer.model").is_file():
        raise ContractError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model): {fix}")
    if tok is not None and tok > vocab:
        raise ContractError(f"{path}/tokenizer.json produces ids up to {tok - 1} but vocab_size is {vocab}: "
                            "tokenizer and weights belong to different models")
    return tok


def tokenizer_json_size(tok: Any, path: Path) -> int:
    """tokenizer_size of an already parsed tokenizer.json (read from path, which errors name)."""
    try:
        vocab = tok["model"]["vocab"]
        top = (max(map(int, vocab.values())) if isinstance(vocab, dict) else len(vocab) - 1) if vocab else -1
        for added in tok.get("added_tokens") or []:
            top = max(top, int(added["id"]))
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise ContractError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from exc
    return top + 1


def _expect(infos: dict[str, TensorInfo], spec: TensorSpec, where: str) -> TensorInfo:
    info = infos.get(spec.name)
    if info is None:
        hint = ""
        if spec.name.endswith("lm_head.weight"):  # config.json says untied (or its architecture's default does)
            hint = (". config.json reads as an untied output head (tie_word_embeddings false, or absent where the "
                    "architecture's default is false); if this model shares its head with the embedding, set "
                    '"tie_word_embeddings": true')
        raise ContractError(f"{spec.name} is missing from the weights ({where}) that config.json describes: the "
                            f"checkpoint is incomplete, or config.json belongs to another model{hint}")
    if info.dtype != ST_CODES[spec.dtype] or info.shape != spec.shape:
        raise ContractError(f"{info.file}: {spec.name}: stored {info.dtype}{list(info.shape)}, the contract wants "
                            f"{ST_CODES[spec.dtype]}{list(spec.shape)} (from config.json: are config and weights "
                            f"from the same model?)")
    return info


def _check_group_size(infos: dict[str, TensorInfo], prefix: str, n: int, k: int, declared: int) -> None:
    """The group size the stored scales imply must be the one config.json declares."""
    info = infos.get(f"{prefix}.weight_scale")
    if info is None or len(info.shape) != 2 or info.shape[0] != n or not info.shape[1]:
        return  # missing or misshapen: _expect reports it with the expected shape
    cols = info.shape[1]
    if k % declared or cols != k // declared:
        stored = f"group size {k // cols}" if k % cols == 0 else "no whole group size"
        raise ContractError(f"{info.file}: {info.name}: {cols} scale columns for K={k} means {stored}, but config.json "
                            f"declares group size {declared}: config and weights disagree")


def _check_tensors(infos: dict[str, TensorInfo], dims: DecoderDims,
                   scheme: W4A8Scheme) -> tuple[Counter[int], dict[str, TensorSpec]]:
    """Every tensor the config implies, stored as the contract says, and nothing else; returns the linears per
    group size and the accepted tensors."""
    where = ", ".join(sorted({info.file.name for info in infos.values()}))
    if dims.layers > len(infos):  # each layer holds many tensors: also bounds the loops below
        raise ContractError(f"config.json: num_hidden_layers={dims.layers} but the weights ({where}) hold only "
                            f"{len(infos)} tensors: config.json belongs to another model")
    expected: dict[str, TensorSpec] = {}
    for spec in bf16_tensor_specs(dims):
        expected[spec.name] = spec
        _expect(infos, spec, where)
    if dims.tied and "lm_head.weight" in infos:
        expected["lm_head.weight"] = TensorSpec("lm_head.weight", torch.bfloat16, (dims.vocab, dims.hidden))
    by_group: Counter[int] = Counter()
    shapes = dims.linear_shapes()
    for i in range(dims.layers):
        for linear in DECODER_LINEARS:
            prefix, (n, k) = linear_prefix(i, linear), shapes[linear]
            _check_group_size(infos, prefix, n, k, scheme.group_size)
            try:
                specs = linear_tensor_specs(prefix, n, k, scheme)
            except ContractError as exc:
                raise ContractError(f"config.json: {exc}") from None
            for spec in specs:
                info = _expect(infos, spec, where)
                if spec.name.endswith(".weight_shape"):
                    stored = read_tensor(info).tolist()
                    if stored != [n, k]:
                        raise ContractError(f"{info.file}: {spec.name} says {stored}, config.json implies "
                                            f"[{n}, {k}]")
                expected[spec.name] = spec
            if linear in dims.biased:
                bias = f"{prefix}.bias"
                expected[bias] = TensorSpec(bias, torch.bfloat16, (n,))
                _expect(infos, expected[bias], where)
            by_group[scheme.group_size] += 1
    if "lm_head.weight" in expected:
        _expect(infos, expected["lm_head.weight"], where)
    extra = sorted(set(infos) - set(expected))
    if extra:
        name = extra[0]
        hint = "not part of a W4A8 checkpoint of this architecture"
        if name.endswith("_proj.bias"):
            hint = (f"a bias that config.json does not give this linear (biased linears of this model: "
                    f"{', '.join(dims.biased) or 'none'}); the model would load without it")
        elif name.startswith("model.layers."):
            layer = int(name.split(".")[2]) if name.split(".")[2].isdigit() else -1
            if layer >= dims.layers:
                hint = f"config.json has num_hidden_layers={dims.layers}: config and weights disagree"
            elif name.endswith("_proj.weight"):
                hint = f"a {infos[name].dtype} weight where the {scheme.format} contract wants INT4"
        raise ContractError(f"unexpected tensor {name} in {infos[name].file.name}: {hint}")
    return by_group, expected


_DECODER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_DECODER_FIELDS = ("num_key_value_heads", "head_dim")


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _read_config(cfg_path: Path) -> dict[str, Any]:
    config = ModelDir.open(cfg_path.parent).config  # ModelDirError (a ContractError) names the file and the fix
    for key in _DECODER_FIELDS + _OPTIONAL_DECODER_FIELDS:
        value = config.get(key)
        if not _positive_int(value) and (key in _DECODER_FIELDS or value is not None):
            raise ContractError(f"{cfg_path}: {key}={value!r} is not a positive integer: restore the source "
                                "model's config.json")
    return config


#: The fields of compressed-tensors' QuantizationArgs (extra="forbid"; the version vLLM 0.32 pins): vLLM refuses any
#: other key in `weights` or `input_activations` when it loads the model.
_QUANT_ARGS_KEYS = frozenset({"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                              "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"})


def _check_quant_args(args: dict[str, Any], at: str) -> None:
    unknown = sorted(map(str, set(args) - _QUANT_ARGS_KEYS))
    if unknown:
        raise ContractError(f"{at}: unknown key {unknown[0]!r} (compressed-tensors, and so vLLM, refuses it): "
                            "remove it")
    if not isinstance(args.get("observer"), str | None) or not isinstance(args.get("observer_kwargs", {}), dict):
        raise ContractError(f"{at}: observer must be a string or null and observer_kwargs an object")
    for key in ("scale_dtype", "zp_dtype", "block_structure"):  # the contract stores BF16 scales and no zero points
        if args.get(key) is not None:
            raise ContractError(f"{at}.{key}={args[key]!r}: the W4A8 contract stores none (null)")


#: compressed-tensors' ActivationOrdering values that leave the stored layout as without ordering ("static" is an
#: alias of "weight"); "group" (alias "dynamic") stores a g_idx.
_LAYOUT_KEEPING_ACTORDER = (None, "static", "weight")

#: Names a decoder linear has in any layer: an `ignore` entry matching one would leave it BF16.
_LINEAR_PROBES = tuple(f"model.layers.{i}.{name}" for i in (0, 17) for name in DECODER_LINEARS)


def _ignored_name(entry: str) -> str | None:
    """What an `ignore` entry leaves out, as the contract knows it: the head's name for "lm_head" or a "re:"
    pattern (compressed-tensors' and vLLM's form, matched from the start of a module name) that matches the head
    and no decoder linear; None for anything else (a pattern that does not compile either)."""
    if entry in IGNORED:
        return entry
    if not entry.startswith("re:"):
        return None
    try:
        pattern = re.compile(entry[3:])
    except re.error:
        return None
    heads = [h for h in IGNORED if pattern.match(h) or pattern.match(f"model.{h}")]
    if len(heads) != 1 or any(pattern.match(probe) for probe in _LINEAR_PROBES):
        return None
    return heads[0]


def check_quantization_scope(qc: Any, where: str) -> None:
    """The parts of `quantization_config` that decide which layers vLLM quantizes, and how: one group that
    targets every Linear, `ignore` exactly the contract's IGNORED (by name or a `re:` pattern matching only it), no
    activation ordering that stores a g_idx, no output or KV-cache quantization. Also the
    types scheme_from_config relies on."""
    if qc is None:
        return  # scheme_from_config names the missing block
    if not isinstance(qc, dict):
        raise ContractError(f"{where}: quantization_config is a JSON {type(qc).__name__}, not an object")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ContractError(f"{where}: quantization_config.config_groups must be an object of objects, got "
                            f"{groups!r:.80}")
    for name, group in groups.items():
        at = f"{where}: quantization_config.config_groups.{name}"
        for key in ("weights", "input_activations"):
            if not isinstance(group.get(key), dict):
                raise ContractError(f"{at}.{key} must be an object, got {group.get(key)!r:.80}")
        weights, acts = group["weights"], group["input_activations"]
        if weights.get("strategy") != "group":
            raise ContractError(f"{at}.weights.strategy={weights.get('strategy')!r}: anychip's checkpoint contract has "
                                "'group' (what `anychip quantize` writes); other strategies are not verified")
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool):
            raise ContractError(f"{at}.weights.group_size={size!r} is not an integer")
        _check_quant_args(weights, f"{at}.weights")
        _check_quant_args(acts, f"{at}.input_activations")
        # Layout-changing options the contract writes as off: group activation ordering stores a g_idx per
        # column (static / weight ordering changes only how GPTQ ran, not what it stored), dynamic weights have no
        # stored scales.
        actorder = weights.get("actorder")
        if actorder not in _LAYOUT_KEEPING_ACTORDER:
            raise ContractError(f"{at}.weights.actorder={actorder!r}: group activation ordering stores a g_idx per "
                                "column and groups that are not contiguous, which the W4A8 contract (and vLLM) do "
                                "not read: re-quantize with actorder 'static' or none")
        if acts.get("group_size") is not None:
            raise ContractError(f"{at}.input_activations.group_size={acts['group_size']!r}: the W4A8 contract "
                                "stores none (null)")
        if weights.get("dynamic", False) is not False:
            raise ContractError(f"{at}.weights.dynamic={weights['dynamic']!r}: W4A8 weights are static (false)")
        if group.get("targets") != ["Linear"]:
            raise ContractError(f"{at}.targets={group.get('targets')!r}: the W4A8 contract quantizes every "
                                'Linear (targets ["Linear"]); layers left out would load as BF16 weights the '
                                "checkpoint does not hold")
        if group.get("output_activations") is not None:
            raise ContractError(f"{at}.output_activations is set: W4A8 quantizes weights and input activations only")
        fmt, top = group.get("format"), qc.get("format")
        if fmt is not None and top is not None and fmt != top:
            raise ContractError(f"{at}.format={fmt!r} but quantization_config.format={top!r}: they must agree")
    ignore = qc.get("ignore")
    if (not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore)
            or {_ignored_name(x) for x in ignore} != set(IGNORED)):
        raise ContractError(f"{where}: quantization_config.ignore={ignore!r:.120}: the W4A8 contract keeps exactly "
                            f"{list(IGNORED)} in BF16 and every decoder linear INT4; a decoder linear in ignore "
                            "would be loaded as BF16 weights the checkpoint does not hold")
    if qc.get("kv_cache_scheme") is not None:
        raise ContractError(f"{where}: quantization_config.kv_cache_scheme is set: the W4A8 contract has no KV-cache "
                            "quantization (and stores no KV scales)")


def verify_checkpoint(path: Path, expect_sha256: dict[str, str] | None = None, *,
                      checksums: bool = True, values: bool = True) -> VerifyReport:
    """Verify a W4A8 directory: SHA256SUMS (every file listed and matching, plus `expect_sha256`), the contract,
    then (unless `values` is False) every stored value. Raises AnychipError (ManifestError, ContractError,
    CheckpointFileError) on the first violation."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise AnychipError(f"{path} is not a directory (make a W4A8 checkpoint with `anychip prepare` or "
                           "`anychip quantize SRC DST`)")
    cfg_path = path / "config.json"
    if cfg_path.is_file() and ModelDir.open(path).quantization_config is None:
        # before the checksums: a BF16 model directory has none to check, and their absence is not its problem
        raise ContractError(f"{cfg_path}: no quantization_config: this is not a W4A8 checkpoint (make one with "
                            "`anychip quantize SRC DST`)")
    if checksums:
        check_manifest(path, expect_sha256)
    config = _read_config(cfg_path)
    architecture = check_architecture(config, str(cfg_path))
    check_quantization_scope(config.get("quantization_config"), str(cfg_path))
    try:
        scheme = scheme_from_config(config)
    except ContractError as exc:
        raise ContractError(f"{cfg_path}: {exc}") from None
    dims = DecoderDims.from_config(config, where=str(cfg_path))
    declared = [v for v in (config.get("torch_dtype"), config.get("dtype")) if v in ("float16", "half")]
    if declared:  # (a value of another type, a list say, is not these strings: vLLM's own check names it)
        raise ContractError(f"{cfg_path}: declares dtype {declared[0]}, which vLLM refuses for this scheme (its "
                            "float tensors are BF16): re-quantize with this anychip, which writes "
                            "\"bfloat16\" there")
    infos = read_tensor_infos(path)
    by_group, accepted = _check_tensors(infos, dims, scheme)
    tok = check_tokenizer(path, dims.vocab, "copy the source model's tokenizer files")
    value_bytes = None
    if values:
        value_bytes = check_values((infos[name], rule) for name, spec in accepted.items()
                                   if (rule := rule_for(name, spec.dtype)) is not None)
    bytes_by_dtype: Counter[str] = Counter()
    for info in infos.values():
        bytes_by_dtype[info.dtype] += info.nbytes
    files = listed_files(path)
    qc = config.get("quantization_config") or {}
    provenance = qc.get("anychip")
    synthetic = config.get("anychip_synthetic")
    return VerifyReport(
        path=path, architecture=architecture, dims=dims, scheme=scheme, tokenizer_size=tok,
        linears_by_group_size=dict(by_group), bytes_by_dtype=dict(bytes_by_dtype),
        total_bytes=sum((path / f).stat().st_size for f in files) + ((path / "SHA256SUMS").stat().st_size
                                                                      if (path / "SHA256SUMS").exists() else 0),
        files=len(files) + int((path / "SHA256SUMS").exists()), checksums_verified=checksums,
        provenance=dict(provenance) if isinstance(provenance, dict) else {},
        synthetic=synthetic if isinstance(synthetic, dict) else None, value_bytes=value_bytes,
    )


def _parse_expect(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, hexd = pair.partition("=")
        if not sep or len(hexd) != 64:
            raise AnychipError(f"--expect-sha256 {pair!r}: expected FILE=HEX with a 64-digit sha256")
        out[name] = hexd
    return out


def adopt_checkpoint(path: Path) -> VerifyReport:
    """A W4A8 checkpoint another tool wrote (no SHA256SUMS): check the contract and every stored value, then write
    SHA256SUMS over its files, so that later `anychip verify` and `anychip serve` check it like one of ours."""
    path = Path(path).absolute()
    if (path / MANIFEST).exists():
        raise ManifestError(f"{path / MANIFEST} exists: verify it as it is (`anychip verify {path}`); to record new "
                            "checksums, delete it first")
    report = verify_checkpoint(path, checksums=False, values=True)
    write_manifest(path)
    return report


def cmd_verify(args: argparse.Namespace) -> int:
    if args.write_sums:
        if args.fast or args.expect_sha256:
            raise AnychipError("--write-sums checks every value and records the digests it finds: it takes neither "
                               "--fast nor --expect-sha256")
        report = adopt_checkpoint(Path(args.dir))
        print(report.summary())
        print(f"wrote {report.path / MANIFEST} over its {report.files} files, after checking the contract and "
              "every value")
        return 0
    report = verify_checkpoint(Path(args.dir), _parse_expect(args.expect_sha256), values=not args.fast)
    print(report.summary())
    return 0


VERIFY_MODES = ("full", "fast", "none")


def verify_before_use(model: Path, mode: str, command: str) -> str | None:
    """What `anychip eval` and `bench latency` run first, as `serve` does: a W4A8 checkpoint (or one anychip made,
    whatever its config now says) is verified, `mode` "full" with the value pass, "fast" without it (checksums,
    headers, contract), "none" not at all. Returns the line to print (None for a model that is not W4A8, which has
    nothing to check); raises ManifestError / ContractError naming the problem, with the way around it."""
    if mode not in VERIFY_MODES:
        raise AnychipError(f"--verify {mode}: use one of {', '.join(VERIFY_MODES)}")
    if mode == "none":
        return f"verify    skipped (--verify none): anychip {command} runs {model} unchecked"
    if not ModelDir.open(model).verifiable:
        return None
    try:
        return verify_checkpoint(model, values=mode == "full").one_line()
    except (ManifestError, ContractError) as exc:
        raise type(exc)(f"{exc} (anychip {command} checks a W4A8 checkpoint first; --verify none skips that)"
                        ) from exc
