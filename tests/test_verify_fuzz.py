"""Property-based fuzzing of `anychip verify` (hypothesis): random damage to config.json, the safetensors headers
and index, the tensor data, SHA256SUMS and the quantization config, usually with SHA256SUMS rewritten over the
damage (so the deeper checks must see it). Every case must end in one of two ways:

- an AnychipError whose message names the damaged file and gives a reason, within 10 s; or
- acceptance, and then an independent oracle (safetensors' own loader, hashlib, the original config) must agree
  that the checkpoint is still one the contract allows: the same contract fields in config.json, a manifest that
  matches, the same tensor names, dtypes and shapes with every value valid.

Any other exception (a crash from deep inside), a hang, or an accepted change the oracle rejects fails the test.
Damage that leaves valid values (another INT4 nibble, another finite BF16, two same-sized tensors' offsets
swapped) under a rewritten SHA256SUMS is accepted and counted apart: only a digest from a trusted source
(`anychip verify --expect-sha256`) can tell such a file from the original. The counts are printed by the last
test; run with -s to see them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import struct
import tempfile
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from anychip.checkpoint.layout import DecoderDims  # noqa: E402
from anychip.checkpoint.manifest import MANIFEST, listed_files, write_manifest  # noqa: E402
from anychip.checkpoint.quantize import quantize_checkpoint  # noqa: E402
from anychip.checkpoint.scheme import W4A8Scheme, scheme_from_config  # noqa: E402
from anychip.checkpoint.verify import verify_checkpoint  # noqa: E402
from anychip.errors import AnychipError  # noqa: E402

EXAMPLES = 50
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=10), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIMEOUT_S = 10
STATS: dict[str, Counter] = {}

JSON = st.recursive(
    st.none() | st.booleans() | st.sampled_from([0, -1, 1, 2, 7, 8, 63, 64, 65, 128, 2 ** 31, 10 ** 12])
    | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
REHASH = st.sampled_from([True, True, True, False])  # mostly: checksums agree with the damage


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """A single-file pack-quantized checkpoint and a sharded (index + 4 shards) int-quantized one."""
    root = tmp_path_factory.mktemp("fuzz")
    src = tiny_llama()
    return {"packed": quantize_checkpoint(src, root / "packed", W4A8Scheme(64)),
            "int-sharded": quantize_checkpoint(src, root / "int-sharded", W4A8Scheme(64, format="int-quantized"),
                                               max_shard_bytes=24_000)}


@contextmanager
def damaged_copy(src: Path):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / src.name
        shutil.copytree(src, d)
        yield d


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"verify did not finish within {TIMEOUT_S} s")


def run_verify(d: Path) -> AnychipError | None:
    """verify_checkpoint(d): None if it passes, the AnychipError if it refuses; anything else propagates."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        verify_checkpoint(d)
        return None
    except AnychipError as exc:
        return exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


SAME, VALID = "accepted (contract unchanged)", "accepted (other valid values)"


def judge(target: str, d: Path, damaged: str, oracle) -> None:
    """Run verify on `d` (whose file `damaged` was corrupted); check the outcome as the module docstring says.
    `oracle(d)` -> (acceptable, SAME | VALID | why not) judges an accepted directory."""
    exc = run_verify(d)
    if exc is None:
        ok, kind = oracle(d)
        assert ok, f"verify accepted a harmful change to {damaged}: {kind}"
        STATS.setdefault(target, Counter())[kind] += 1
        return
    msg = str(exc)
    assert damaged in msg, f"{type(exc).__name__} does not name {damaged}: {msg}"
    assert len(msg.split()) >= 5, f"no reason given: {msg}"
    STATS.setdefault(target, Counter())["caught"] += 1


# ---- config.json ------------------------------------------------------------------------------------------------

#: compressed-tensors' QuantizationArgs defaults: a missing key means this to vLLM.
_ARG_DEFAULTS = dict(num_bits=8, type="int", symmetric=True, group_size=None, strategy=None, block_structure=None,
                     dynamic=False, actorder=None, scale_dtype=None, zp_dtype=None)


def _args_view(args: dict) -> dict:
    return _ARG_DEFAULTS | {k: v for k, v in args.items() if k not in ("observer", "observer_kwargs")}


def _contract_view(config: dict) -> tuple:
    qc = config["quantization_config"]
    (group,) = qc["config_groups"].values()
    return (config.get("architectures"), DecoderDims.from_config(config), scheme_from_config(config),
            group.get("targets"), sorted(qc.get("ignore")), qc.get("kv_cache_scheme"), group.get("output_activations"),
            _args_view(group["weights"]), _args_view(group["input_activations"]))


def _loads_in_compressed_tensors(qc: dict) -> bool:
    """What vLLM's loader requires of the free-form fields (QuantizationArgs: observer str | None, kwargs a dict)."""
    (group,) = qc["config_groups"].values()
    return all(isinstance(args.get("observer"), str | None) and isinstance(args.get("observer_kwargs", {}), dict)
               for args in (group["weights"], group["input_activations"]))


def _same_contract(original: dict):
    def oracle(d: Path) -> tuple[bool, str]:
        new = json.loads((d / "config.json").read_text())
        if not _loads_in_compressed_tensors(new["quantization_config"]):
            return False, "vLLM's compressed-tensors loader would refuse the observer fields"
        if _contract_view(new) != _contract_view(original):
            return False, "contract fields differ from the original"
        return True, SAME
    return oracle


def _bytes_edit(data: st.DataObject, raw: bytes) -> bytes:
    op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
    i = data.draw(st.integers(0, max(len(raw) - 1, 0)))
    if op == "flip":
        return raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:]
    if op == "insert":
        return raw[:i] + data.draw(st.binary(min_size=1, max_size=8)) + raw[i:]
    if op == "delete":
        return raw[:i] + raw[i + data.draw(st.integers(1, 8)):]
    return raw[:i]


@FUZZ
@given(data=st.data())
def test_fuzz_config_json(checkpoints, data):
    name = data.draw(st.sampled_from(sorted(checkpoints)))
    with damaged_copy(checkpoints[name]) as d:
        path = d / "config.json"
        original_bytes = path.read_bytes()
        config = json.loads(original_bytes)
        op = data.draw(st.sampled_from(["set", "delete", "bytes"]))
        keys = sorted(set(config) | {"head_dim", "num_key_value_heads"})
        if op == "bytes":
            path.write_bytes(_bytes_edit(data, original_bytes))
        else:
            new = dict(config)
            key = data.draw(st.sampled_from(keys))
            if op == "set":
                new[key] = data.draw(JSON)
            else:
                new.pop(key, None)
            path.write_text(json.dumps(new, indent=2))
        if data.draw(REHASH):
            write_manifest(d)
        judge("config.json", d, "config.json", _same_contract(config))


# ---- quantization_config ----------------------------------------------------------------------------------------

def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(data=st.data())
def test_fuzz_quantization_config(checkpoints, data):
    name = data.draw(st.sampled_from(sorted(checkpoints)))
    with damaged_copy(checkpoints[name]) as d:
        config = json.loads((d / "config.json").read_text())
        new = json.loads(json.dumps(config))
        qc = new["quantization_config"]
        path = data.draw(st.sampled_from(list(_paths(qc))[1:]))
        parent = qc
        for k in path[:-1]:
            parent = parent[k]
        op = data.draw(st.sampled_from(["set", "delete", "add"]))
        if op == "set":
            parent[path[-1]] = data.draw(JSON)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8))] = data.draw(JSON)
        else:
            parent.append(data.draw(JSON))
        (d / "config.json").write_text(json.dumps(new, indent=2))
        write_manifest(d)
        judge("quantization_config", d, "config.json", _same_contract(config))


# ---- safetensors headers and the index --------------------------------------------------------------------------

def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _load_all(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(d.glob("*.safetensors")):
        out |= load_file(path)
    return out


def _same_tensors(original: Path):
    def oracle(d: Path) -> tuple[bool, str]:
        try:
            new = _load_all(d)
        except Exception as exc:  # the oracle: safetensors' own loader
            return False, f"safetensors cannot load it ({exc})"
        old = _load_all(original)
        if new.keys() != old.keys():
            return False, f"tensor names differ: {sorted(new.keys() ^ old.keys())[:3]}"
        same = True
        for k, t in old.items():
            if t.dtype != new[k].dtype or t.shape != new[k].shape:
                return False, f"{k} is stored as {new[k].dtype} {list(new[k].shape)}"
            same = same and torch.equal(t.reshape(-1).view(torch.uint8), new[k].reshape(-1).view(torch.uint8))
        return (True, SAME) if same else _values_valid(d)
    return oracle


@FUZZ
@given(data=st.data())
def test_fuzz_headers(checkpoints, data):
    name = data.draw(st.sampled_from(sorted(checkpoints)))
    src = checkpoints[name]
    with damaged_copy(src) as d:
        files = sorted(p.name for p in d.glob("*.safetensors")) + sorted(p.name for p in d.glob("*.index.json"))
        target = data.draw(st.sampled_from(files))
        path = d / target
        if target.endswith(".index.json"):
            index = json.loads(path.read_text())
            wm = index["weight_map"]
            tensor = data.draw(st.sampled_from(sorted(wm)))
            op = data.draw(st.sampled_from(["move", "delete", "add", "escape", "json"]))
            if op == "move":
                wm[tensor] = data.draw(st.sampled_from(sorted(set(wm.values()))))
            elif op == "delete":
                del wm[tensor]
            elif op == "add":
                wm[tensor + data.draw(st.text(min_size=1, max_size=3))] = wm[tensor]
            elif op == "escape":
                wm[tensor] = data.draw(st.sampled_from(["../" + wm[tensor], "/etc/passwd", "sub/x.safetensors"]))
            else:
                index[data.draw(st.sampled_from(["weight_map", "metadata"]))] = data.draw(JSON)
            path.write_text(json.dumps(index))
        else:
            header, body = _split(path)
            tensors = sorted(k for k in header if k != "__metadata__")
            tensor = data.draw(st.sampled_from(tensors))
            entry = header[tensor]
            op = data.draw(st.sampled_from(["dtype", "shape", "offsets", "swap", "delete", "rename", "duplicate",
                                            "metadata", "raw", "length"]))
            raw = None
            if op == "dtype":
                entry["dtype"] = data.draw(st.sampled_from(["BF16", "F16", "F32", "I8", "U8", "I16", "I32", "I64",
                                                            "F64", "BOOL", "F8_E4M3", "Q4"]) | JSON)
            elif op == "shape":
                entry["shape"] = data.draw(st.lists(st.integers(-2, 300), max_size=4) | JSON)
            elif op == "offsets":
                b, e = entry["data_offsets"]
                entry["data_offsets"] = [b + data.draw(st.integers(-64, 64)), e + data.draw(st.integers(-64, 64))]
            elif op == "swap":
                other = header[data.draw(st.sampled_from(tensors))]
                entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
            elif op == "delete":
                del header[tensor]
            elif op == "rename":
                header[tensor + data.draw(st.text(min_size=1, max_size=3))] = header.pop(tensor)
            elif op == "duplicate":
                header[tensor + ".copy"] = dict(entry)
            elif op == "metadata":
                header["__metadata__"] = data.draw(JSON)
            elif op == "raw":
                n = struct.unpack("<Q", path.read_bytes()[:8])[0]
                raw = bytearray(path.read_bytes())
                for _ in range(data.draw(st.integers(1, 4))):
                    raw[data.draw(st.integers(8, 8 + n - 1))] = data.draw(st.integers(0, 255))
            else:
                raw = bytearray(path.read_bytes())
                n = struct.unpack("<Q", raw[:8])[0]
                raw[:8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, n - 8, n + 8, 2 ** 63]) |
                                                      st.integers(0, n + 64)))
            path.write_bytes(bytes(raw) if raw is not None else _join(header, body))
        if data.draw(REHASH):
            write_manifest(d)
        judge("headers", d, target, _same_tensors(src))


# ---- tensor data ------------------------------------------------------------------------------------------------

def _values_valid(d: Path) -> tuple[bool, str]:
    """Independent of anychip's reader: safetensors loads every tensor, checked in float32 / int32."""
    for name, t in _load_all(d).items():
        if t.dtype == torch.bfloat16:
            x = t.float()
            if not bool(torch.isfinite(x).all()):
                return False, f"{name} has a non-finite value"
            if name.endswith(".weight_scale") and not bool((x > 0).all()):
                return False, f"{name} has a scale <= 0"
        elif t.dtype == torch.int8 and not bool(((t.int() >= -8) & (t.int() <= 7)).all()):
            return False, f"{name} has an INT4 value out of range"
    return True, VALID


def _data_oracle(original: Path):
    def oracle(d: Path) -> tuple[bool, str]:
        ok, kind = _values_valid(d)
        same = all((d / f).read_bytes() == (original / f).read_bytes() for f in listed_files(original))
        return ok, SAME if ok and same else kind
    return oracle


@FUZZ
@given(data=st.data())
def test_fuzz_tensor_data(checkpoints, data):
    from anychip.checkpoint.io import read_tensor_infos

    name = data.draw(st.sampled_from(sorted(checkpoints)))
    with damaged_copy(checkpoints[name]) as d:
        infos = read_tensor_infos(d)
        info = infos[data.draw(st.sampled_from(sorted(infos)))]
        mode = data.draw(st.sampled_from(["bytes", "value"]))
        if mode == "value" and info.dtype in ("BF16", "I8"):
            dtype = info.torch_dtype
            value = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, 1e-3])
                              if dtype == torch.bfloat16 else st.integers(-128, 127))
            blob = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
        else:
            blob = data.draw(st.binary(min_size=1, max_size=8))
        at = info.start + data.draw(st.integers(0, max(info.nbytes - len(blob), 0)))
        blob = blob[:info.end - at]
        with open(info.file, "r+b") as f:
            f.seek(at)
            f.write(blob)
        if data.draw(REHASH):
            write_manifest(d)
        judge("tensor data", d, info.file.name, _data_oracle(checkpoints[name]))


# ---- SHA256SUMS -------------------------------------------------------------------------------------------------

def _manifest_true(d: Path) -> tuple[bool, str]:
    """hashlib over every file against an independent reading of SHA256SUMS (sha256sum's two line forms)."""
    entries = {}
    try:
        text = (d / MANIFEST).read_text()
    except UnicodeDecodeError:
        return False, "SHA256SUMS is not text"
    for line in text.splitlines():
        hexd, name = line[:64], line[66:]
        if len(line) < 67 or line[64:66] not in ("  ", " *") or not all(c in "0123456789abcdefABCDEF" for c in hexd):
            return False, f"bad line {line!r}"
        entries[name] = hexd.lower()
    if set(entries) != set(listed_files(d)):
        return False, "SHA256SUMS does not list exactly the files"
    for name, want in entries.items():
        if hashlib.sha256((d / name).read_bytes()).hexdigest() != want:
            return False, f"{name} does not match"
    return True, SAME


@FUZZ
@given(data=st.data())
def test_fuzz_sha256sums(checkpoints, data):
    name = data.draw(st.sampled_from(sorted(checkpoints)))
    with damaged_copy(checkpoints[name]) as d:
        path = d / MANIFEST
        lines = path.read_text().splitlines()
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["hex", "drop", "duplicate", "add", "swap", "garble", "binary-mark", "upper",
                                        "bytes", "empty", "self"]))
        if op == "hex":
            j = data.draw(st.integers(0, 63))
            c = data.draw(st.sampled_from([x for x in "0123456789abcdef" if x != lines[i][j]]))
            lines[i] = lines[i][:j] + c + lines[i][j + 1:]
        elif op == "drop":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "add":
            lines.append(f"{data.draw(st.text('0123456789abcdef', min_size=64, max_size=64))}  "
                         f"{data.draw(st.sampled_from(['extra.bin', '../config.json', '/etc/hostname', 'x y']))}")
        elif op == "swap":
            j = data.draw(st.integers(0, len(lines) - 1))
            a, b = lines[i].split("  ", 1), lines[j].split("  ", 1)
            lines[i], lines[j] = f"{a[0]}  {b[1]}", f"{b[0]}  {a[1]}"
        elif op == "garble":
            lines[i] = data.draw(st.text(max_size=80))
        elif op == "binary-mark":
            lines[i] = lines[i].replace("  ", " *", 1)
        elif op == "upper":
            lines[i] = lines[i][:64].upper() + lines[i][64:]
        elif op == "self":
            lines.append(f"{'0' * 64}  {MANIFEST}")
        if op == "bytes":
            path.write_bytes(_bytes_edit(data, path.read_bytes()))
        else:
            path.write_text("" if op == "empty" else "\n".join(lines) + "\n")
        judge("SHA256SUMS", d, MANIFEST, _manifest_true)


def test_fuzz_summary():
    """The figures for the closing note (printed; run with -s), and proof that each target ran and caught."""
    total = sum(STATS.values(), Counter())
    lines = [f"{target:20s} tried {c.total():4d}  caught {c['caught']:4d}  {SAME} {c[SAME]:4d}  {VALID} {c[VALID]:4d}"
             for target, c in [*STATS.items(), ("all", total)]]
    print("\nverify fuzz:\n" + "\n".join(lines))
    if len(STATS) == 5:  # the whole file ran
        assert all(c.total() >= EXAMPLES // 2 and c["caught"] > 0 for c in STATS.values()), STATS
