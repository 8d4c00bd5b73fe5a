"""The value pass of `anychip verify`: every stored number is one the W4A8 contract allows.

SHA256SUMS proves that the files are the ones the writer wrote, not that the writer wrote sense: a buggy
quantizer or a hand edit followed by a rehash leaves NaN scales that checksums cannot see. The rules, by role:

    *.weight_scale (BF16)          positive normal numbers whose weights 8 s stay finite (SCALE_MIN..SCALE_MAX)
    int-quantized *.weight (I8)    in [-8, 7]
    every other BF16 tensor        finite (embedding, norms, lm_head, biases)
    pack-quantized words (I32)     not read: every bit pattern is eight valid nibbles
    *.weight_shape (I64)           checked by the contract pass against config.json

Tensors are streamed file by file in offset order through one buffer of `chunk_bytes`, so memory stays flat
however large the checkpoint is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from anychip.checkpoint.io import ST_CODES, CheckpointFileError, TensorInfo
from anychip.checkpoint.scheme import ContractError
from anychip.formats import SCALE_MAX

CHUNK_BYTES = 16 << 20
_REQUANTIZE = "re-quantize from the BF16 model (`anychip quantize SRC DST`, or `anychip prepare --force`)"


@dataclass(frozen=True)
class ValueRule:
    """What one kind of tensor may hold: `bad(chunk)` marks the entries that break it; `any_bad(chunk)` says
    whether there is one, by reductions only (no mask: the fast path for the common, clean chunk)."""

    what: str
    dtype: torch.dtype
    bad: Callable[[torch.Tensor], torch.Tensor]
    any_bad: Callable[[torch.Tensor], bool]
    fix: str


# BF16 rules work on the bits (three times faster than float compares on CPU; test_verify_values checks all 65536
# patterns against the float definitions): exponent all ones is inf or NaN; as int16, a value <= 0 has its sign
# bit set or is +0.0 (-0.0 is 0x8000, negative as int16).
_EXPONENT = 0x7F80


def _bf16_nonfinite(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int16) & _EXPONENT) == _EXPONENT


def _bf16_any_nonfinite(x: torch.Tensor) -> bool:
    return int((x.view(torch.int16) & _EXPONENT).max()) == _EXPONENT


# The scales the contract allows (formats.SCALE_MIN..SCALE_MAX), as BF16 bits (int16): positive, exponent 1..251
# (2^-126 <= s < 2^125); zero, subnormals, negatives, the exponents 252..254 (8 s overflows), inf and NaN all fall
# outside.
_SCALE_BITS = (0x0080, 0x7DFF)


def _bf16_bad_scale(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int16)
    return (bits < _SCALE_BITS[0]) | (bits > _SCALE_BITS[1])


def _bf16_any_bad_scale(x: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(x.view(torch.int16))
    return int(lo) < _SCALE_BITS[0] or int(hi) > _SCALE_BITS[1]



def _int4_any_out_of_range(x: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(x)
    return int(lo) < -8 or int(hi) > 7


SCALE = ValueRule(f"group scales must be positive normal numbers up to {SCALE_MAX:.3g} (finite, > 0, not "
                  "subnormal, 8 s finite)", torch.bfloat16, _bf16_bad_scale, _bf16_any_bad_scale,
                  "a zero, negative, subnormal, huge or non-finite scale turns its whole group of weights into 0, "
                  f"sign-flipped, inf or NaN; {_REQUANTIZE}")
INT4 = ValueRule("int-quantized weights must lie in [-8, 7]", torch.int8, lambda x: (x < -8) | (x > 7),
                 _int4_any_out_of_range,
                 f"INT4 values are stored one per int8 and the kernels read only the low nibble; {_REQUANTIZE}")
FINITE = ValueRule("BF16 tensors must be finite", torch.bfloat16, _bf16_nonfinite, _bf16_any_nonfinite,
                   "one NaN or inf poisons every token that reaches it; the BF16 source or its conversion produced "
                   "it: fix the source model, then re-quantize")


def rule_for(name: str, dtype: torch.dtype) -> ValueRule | None:
    """The rule for a tensor the contract pass accepted (name and dtype as the contract wants them)."""
    if dtype == torch.bfloat16:
        return SCALE if name.endswith(".weight_scale") else FINITE
    if dtype == torch.int8 and name.endswith(".weight"):
        return INT4
    return None


def _index(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for d in reversed(shape):
        flat, i = divmod(flat, d)
        out.append(i)
    return out[::-1]


def check_values(tensors: Iterable[tuple[TensorInfo, ValueRule]], chunk_bytes: int = CHUNK_BYTES) -> int:
    """Apply each tensor's rule to its stored values; returns the bytes read. Raises ContractError naming the
    file, the tensor, the first bad index and its value, or CheckpointFileError if a file cannot be read."""
    by_file: dict = {}
    for info, rule in tensors:
        if ST_CODES.get(rule.dtype) != info.dtype:
            raise ValueError(f"{info.name}: rule for {rule.dtype} applied to {info.dtype}")  # a caller's bug
        by_file.setdefault(info.file, []).append((info, rule))
    buf = bytearray(max(chunk_bytes, 8))
    view = memoryview(buf)
    read = 0
    for path, items in by_file.items():
        try:
            with open(path, "rb") as f:
                for info, rule in sorted(items, key=lambda item: item[0].start):
                    read += _check_tensor(f, info, rule, view)
        except OSError as exc:
            raise CheckpointFileError(f"{path}: unreadable during the value check ({exc})") from exc
    return read


def _check_tensor(f, info: TensorInfo, rule: ValueRule, view: memoryview) -> int:
    itemsize = torch.empty((), dtype=rule.dtype).element_size()
    step = len(view) // itemsize * itemsize
    f.seek(info.start)
    done = 0
    while done < info.nbytes:
        want = min(step, info.nbytes - done)
        got = f.readinto(view[:want])
        if got != want:
            raise CheckpointFileError(f"{info.file}: {info.name} ends early at byte {info.start + done + got}: "
                                      "the file shrank while being checked; re-create it")
        chunk = torch.frombuffer(view[:want], dtype=rule.dtype)
        if rule.any_bad(chunk):
            i = int(rule.bad(chunk).nonzero()[0])
            flat = done // itemsize + i
            value = chunk[i].item()
            raise ContractError(f"{info.file}: {info.name}{_index(flat, info.shape)} = {value}: {rule.what}; "
                                f"{rule.fix}")
        done += want
    return done
