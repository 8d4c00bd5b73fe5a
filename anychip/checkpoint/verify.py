"""`anychip verify DIR`: checksums, then the W4A8 checkpoint contract, from safetensors headers only.

The contract: a LlamaForCausalLM whose every decoder linear is stored exactly as `layout.linear_tensor_specs`
says for the declared scheme; embedding, norms (and lm_head if present) BF16; config, tokenizer and weights
of one model. The first violation raises ContractError (or ManifestError / CheckpointFileError) naming the
file or tensor.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anychip.checkpoint.io import ST_CODES, TensorInfo, read_tensor, read_tensor_infos
from anychip.checkpoint.layout import LlamaDims, TensorSpec, bf16_tensor_specs, linear_prefix, linear_tensor_specs
from anychip.checkpoint.manifest import check_manifest, listed_files
from anychip.checkpoint.scheme import DECODER_LINEARS, ContractError, W4A8Scheme, scheme_from_config
from anychip.errors import AnychipError


@dataclass
class VerifyReport:
    """What `verify_checkpoint` found; `summary()` is the one-screen text `anychip verify` prints."""

    path: Path
    architecture: str
    dims: LlamaDims
    scheme: W4A8Scheme
    tokenizer_size: int | None
    linears_by_group_size: dict[int, int]
    bytes_by_dtype: dict[str, int]
    total_bytes: int
    files: int
    checksums_verified: bool
    provenance: dict[str, Any] = field(default_factory=dict)
    synthetic: dict[str, Any] | None = None

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
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"


def tokenizer_size(directory: Path) -> int | None:
    """Token ids the tokenizer can produce (max id + 1) from tokenizer.json; None without one."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = json.loads(path.read_text())
        vocab = tok["model"]["vocab"]
        top = (max(vocab.values()) if isinstance(vocab, dict) else len(vocab) - 1) if vocab else -1
        for added in tok.get("added_tokens") or []:
            top = max(top, int(added["id"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ContractError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from exc
    return top + 1


def _expect(infos: dict[str, TensorInfo], spec: TensorSpec) -> TensorInfo:
    info = infos.get(spec.name)
    if info is None:
        raise ContractError(f"{spec.name} is missing from the weights: the checkpoint is incomplete")
    if info.dtype != ST_CODES[spec.dtype] or info.shape != spec.shape:
        raise ContractError(f"{spec.name}: stored {info.dtype}{list(info.shape)}, the contract wants "
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
        raise ContractError(f"{info.name}: {cols} scale columns for K={k} means {stored}, but config.json "
                            f"declares group size {declared}: config and weights disagree")


def _check_tensors(infos: dict[str, TensorInfo], dims: LlamaDims, scheme: W4A8Scheme) -> Counter[int]:
    expected: dict[str, TensorSpec] = {}
    for spec in bf16_tensor_specs(dims):
        expected[spec.name] = spec
        _expect(infos, spec)
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
                info = _expect(infos, spec)
                if spec.name.endswith(".weight_shape"):
                    stored = read_tensor(info).tolist()
                    if stored != [n, k]:
                        raise ContractError(f"{spec.name} says {stored}, config.json implies [{n}, {k}]")
                expected[spec.name] = spec
            bias = f"{prefix}.bias"
            if bias in infos:
                expected[bias] = TensorSpec(bias, torch.bfloat16, (n,))
                _expect(infos, expected[bias])
            by_group[scheme.group_size] += 1
    if "lm_head.weight" in expected:
        _expect(infos, expected["lm_head.weight"])
    extra = sorted(set(infos) - set(expected))
    if extra:
        name = extra[0]
        hint = "not part of a W4A8 Llama checkpoint"
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2]) if name.split(".")[2].isdigit() else -1
            if layer >= dims.layers:
                hint = f"config.json has num_hidden_layers={dims.layers}: config and weights disagree"
            elif name.endswith("_proj.weight"):
                hint = f"a {infos[name].dtype} weight where the {scheme.format} contract wants INT4"
        raise ContractError(f"unexpected tensor {name} in {infos[name].file.name}: {hint}")
    return by_group


def verify_checkpoint(path: Path, expect_sha256: dict[str, str] | None = None, *,
                      checksums: bool = True) -> VerifyReport:
    """Verify a W4A8 directory: SHA256SUMS (every file listed and matching, plus `expect_sha256`), then the
    contract. Raises AnychipError (ManifestError, ContractError, CheckpointFileError) on the first violation."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise AnychipError(f"{path} is not a directory (make a W4A8 checkpoint with `anychip prepare` or "
                           "`anychip quantize SRC DST`)")
    if checksums:
        check_manifest(path, expect_sha256)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ContractError(f"{cfg_path} is missing")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ContractError(f"{cfg_path}: not valid JSON ({exc})") from exc
    archs = config.get("architectures") or []
    if archs != ["LlamaForCausalLM"]:
        raise ContractError(f"{cfg_path}: architectures {archs}, the W4A8 contract covers LlamaForCausalLM only")
    scheme = scheme_from_config(config)
    dims = LlamaDims.from_config(config, where=str(cfg_path))
    infos = read_tensor_infos(path)
    by_group = _check_tensors(infos, dims, scheme)
    tok = tokenizer_size(path)
    if tok is None and not (path / "tokenizer.model").is_file():
        raise ContractError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model): copy the source model's "
                            "tokenizer files")
    if tok is not None and tok > dims.vocab:
        raise ContractError(f"{path}/tokenizer.json produces ids up to {tok - 1} but vocab_size is {dims.vocab}: "
                            "tokenizer and weights belong to different models")
    bytes_by_dtype: Counter[str] = Counter()
    for info in infos.values():
        bytes_by_dtype[info.dtype] += info.nbytes
    files = listed_files(path)
    qc = config.get("quantization_config") or {}
    return VerifyReport(
        path=path, architecture=archs[0], dims=dims, scheme=scheme, tokenizer_size=tok,
        linears_by_group_size=dict(by_group), bytes_by_dtype=dict(bytes_by_dtype),
        total_bytes=sum((path / f).stat().st_size for f in files) + ((path / "SHA256SUMS").stat().st_size
                                                                      if (path / "SHA256SUMS").exists() else 0),
        files=len(files) + int((path / "SHA256SUMS").exists()), checksums_verified=checksums,
        provenance=dict(qc.get("anychip") or {}), synthetic=config.get("anychip_synthetic"),
    )


def _parse_expect(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, hexd = pair.partition("=")
        if not sep or len(hexd) != 64:
            raise AnychipError(f"--expect-sha256 {pair!r}: expected FILE=HEX with a 64-digit sha256")
        out[name] = hexd
    return out


def cmd_verify(args: argparse.Namespace) -> int:
    report = verify_checkpoint(Path(args.dir), _parse_expect(args.expect_sha256))
    print(report.summary())
    return 0
