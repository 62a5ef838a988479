"""The mutations: m_*(rng, ctx) edits the case's copy of a seed in place and returns a description (raising
Skip when it does not apply to this seed); ctx.structural False marks a data mutation (no silent check).
MUTATIONS weighs them and says where each applies; apply_mutation draws one with the case's Random.

They run in the child (child.child_case), never in the parent: the qmodel.pt edits (m_pt_*) use torch.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .common import MB
from .formats import (G_ARRAY, G_SCALAR, G_STRING, ST_FMT, ST_ITEMSIZE, GKv, Gguf, GTensor, st_pack, st_read,
                      st_remove, st_tensors, zip_spans)


class Skip(Exception):
    """The mutation does not apply to this seed."""


@dataclass
class Ctx:
    root: Path  # the case's copy of the seed
    input: Path  # what the CLI is given
    reader: str
    structural: bool = True

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file())

    def weights(self) -> list[Path]:
        return [p for p in self.files() if p.suffix in (".safetensors", ".uqff", ".gguf") or p.name == "qmodel.pt"]

    def st_files(self) -> list[Path]:
        return [p for p in self.files() if p.suffix in (".safetensors", ".uqff")]

    def jsons(self) -> list[Path]:
        return [p for p in self.files() if p.suffix == ".json"]

    def rel(self, p: Path) -> str:
        return str(p.relative_to(self.root))


def _pick(rng: random.Random, items, what="item"):
    items = list(items)
    if not items:
        raise Skip(f"no {what}")
    return items[rng.randrange(len(items))]


def _pick_weight_file(rng, ctx: Ctx, files=None) -> Path:
    files = ctx.weights() if files is None else files
    if not files:
        raise Skip("no weight file")
    # the biggest file (the model's tensors) half of the time
    return max(files, key=lambda p: p.stat().st_size) if rng.random() < 0.5 else _pick(rng, files)


def _kind_of(path: Path) -> str:
    if path.suffix in (".safetensors", ".uqff"):
        return "st"
    if path.suffix == ".gguf":
        return "gguf"
    if path.name == "qmodel.pt":
        return "zip" if zipfile.is_zipfile(path) else "pickle"
    return "other"


def _boundaries(path: Path) -> list[int]:
    size = path.stat().st_size
    kind = _kind_of(path)
    try:
        if kind == "st":
            b, n, h = st_read(path)
            bounds = [0, 8, 8 + n]
            for name in st_tensors(h)[:200]:
                s, e = h[name]["data_offsets"]
                bounds += [8 + n + s, 8 + n + e]
            return bounds
        if kind == "gguf":
            return Gguf(path.read_bytes()).boundaries()
        if kind == "zip":
            z = zip_spans(path)
            return [x for m in z["members"] for x in m[1:]] + [z["central"], z["eocd"]]
    except Exception:
        pass
    return [0, size // 2, size - 1]


def m_truncate(rng, ctx):
    f = _pick_weight_file(rng, ctx) if rng.random() < 0.8 or not ctx.jsons() else _pick(rng, ctx.jsons())
    data = f.read_bytes()
    cut = rng.randrange(0, max(1, len(data)))
    f.write_bytes(data[:cut])
    return f"truncate {ctx.rel(f)} at byte {cut} of {len(data)}"


def m_truncate_boundary(rng, ctx):
    f = _pick_weight_file(rng, ctx)
    data = f.read_bytes()
    cut = _pick(rng, _boundaries(f)) + rng.choice((-1, 0, 0, 1))
    cut = min(max(cut, 0), len(data) - 1)
    f.write_bytes(data[:cut])
    return f"truncate {ctx.rel(f)} at structure boundary byte {cut} of {len(data)}"


def _flip(rng, data: bytearray, lo: int, hi: int, k: int) -> list[int]:
    where = []
    for _ in range(k):
        i = rng.randrange(lo, max(lo + 1, hi))
        if i < len(data):
            data[i] ^= (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(1, 256)
            where.append(i)
    return where


def m_flip(rng, ctx):
    ctx.structural = False
    f = _pick_weight_file(rng, ctx)
    data = bytearray(f.read_bytes())
    where = _flip(rng, data, 0, len(data), rng.choice((1, 1, 2, 4, 8, 32)))
    f.write_bytes(data)
    return f"flip bytes {where[:8]}{'...' if len(where) > 8 else ''} of {ctx.rel(f)} (uniform)"


def _header_span(f: Path) -> tuple[int, int, str]:
    kind = _kind_of(f)
    if kind == "st":
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        return 8, 8 + n, "safetensors JSON header"
    if kind == "gguf":
        g = Gguf(f.read_bytes())
        return 0, g.header_end, "GGUF metadata and tensor infos"
    if kind == "zip":
        for name, _, s, e in zip_spans(f)["members"]:
            if name.endswith("data.pkl"):
                return s, e, "data.pkl"
    return 0, f.stat().st_size, "file"


def m_flip_header(rng, ctx):
    ctx.structural = False
    f = _pick_weight_file(rng, ctx)
    lo, hi, what = _header_span(f)
    data = bytearray(f.read_bytes())
    where = _flip(rng, data, lo, hi, rng.choice((1, 1, 1, 2, 3, 8)))
    f.write_bytes(data)
    return f"flip bytes {where} of {ctx.rel(f)} ({what})"


# -- safetensors header edits ----------------------------------------------------------------------------------

def _st_pick(rng, ctx, small=False):
    f = _pick_weight_file(rng, ctx, [p for p in ctx.st_files() if st_read(p)[2].keys() - {"__metadata__"}])
    b, n, h = st_read(f)
    names = st_tensors(h)
    if small:
        names = [k for k in names if h[k]["dtype"] in ST_FMT and h[k]["data_offsets"][1] - h[k]["data_offsets"][0] <= 64]
    return f, b, n, h, _pick(rng, names, "tensor")


def _st_write_header(f: Path, b: bytes, n: int, h: dict, raw: bytes | None = None) -> None:
    f.write_bytes(st_pack(h, b[8 + n:], raw))


def m_st_dtype(rng, ctx):
    f, b, n, h, name = _st_pick(rng, ctx)
    old = h[name]["dtype"]
    new = rng.choice(["F16", "BF16", "F32", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL",
                      "F8_E4M3", "X9", "", None, 3, "f16"])
    if new == old:
        new = "F64" if old != "F64" else "I8"
    if {old, new} <= {"F16", "BF16"}:
        ctx.structural = False  # a float16 <-> bfloat16 reinterpretation cannot be detected
    h[name]["dtype"] = new
    _st_write_header(f, b, n, h)
    return f"safetensors {ctx.rel(f)}: dtype of {name} {old} -> {new!r}"


def m_st_shape(rng, ctx):
    f, b, n, h, name = _st_pick(rng, ctx)
    shape = list(h[name]["shape"])
    op = rng.choice(["reverse", "append1", "prepend1", "flatten", "split", "zero", "neg", "2^31", "2^63", "2^64",
                     "scalar", "string", "float"])
    if op == "reverse":
        new = shape[::-1]
    elif op == "append1":
        new = shape + [1]
    elif op == "prepend1":
        new = [1] + shape
    elif op == "flatten":
        p = 1
        for d in shape:
            p *= d
        new = [p]
    elif op == "split" and shape and shape[0] % 2 == 0:
        new = [shape[0] // 2, 2 * (shape[1] if len(shape) > 1 else 1)] + shape[2:]
    elif op in ("zero", "neg", "2^31", "2^63", "2^64") and shape:
        new = list(shape)
        new[rng.randrange(len(new))] = {"zero": 0, "neg": -1, "2^31": 2**31, "2^63": 2**63, "2^64": 2**64}[op]
    elif op == "scalar":
        new = []
    elif op == "string":
        new = "x"
    else:
        new = [d + 0.5 for d in shape] or [1.5]
    h[name]["shape"] = new
    _st_write_header(f, b, n, h)
    return f"safetensors {ctx.rel(f)}: shape of {name} {shape} -> {new!r} ({op})"


def m_st_offsets(rng, ctx):
    f, b, n, h, name = _st_pick(rng, ctx)
    s, e = h[name]["data_offsets"]
    names = st_tensors(h)
    size = len(b) - 8 - n
    op = rng.choice(["begin+1", "end-1", "end+1", "empty", "reversed", "past-end", "2^63", "negative", "one",
                     "overlap", "swap-same-size", "string"])
    if op == "begin+1":
        new = [s + 1, e]
    elif op == "end-1":
        new = [s, e - 1]
    elif op == "end+1":
        new = [s, e + 1]
    elif op == "empty":
        new = [s, s]
    elif op == "reversed":
        new = [e, s]
    elif op == "past-end":
        new = [s, size * 2 + 8]
    elif op == "2^63":
        new = [s, 2**63]
    elif op == "negative":
        new = [-8, e]
    elif op == "one":
        new = [s]
    elif op == "overlap":
        other = _pick(rng, [k for k in names if k != name] or [name])
        os_, _ = h[other]["data_offsets"]
        new = [os_, os_ + (e - s)]
    elif op == "swap-same-size":
        same = [k for k in names if k != name and h[k]["data_offsets"][1] - h[k]["data_offsets"][0] == e - s
                and h[k]["dtype"] == h[name]["dtype"] and h[k]["shape"] == h[name]["shape"]]
        if not same:
            raise Skip("no same-size tensor")
        other = _pick(rng, same)
        h[other]["data_offsets"], new = [s, e], list(h[other]["data_offsets"])
        op += f" with {other}"
        ctx.structural = False  # two identical-looking tensors swapped: a data mutation
    else:
        new = "0:8"
    h[name]["data_offsets"] = new
    _st_write_header(f, b, n, h)
    return f"safetensors {ctx.rel(f)}: data_offsets of {name} {[s, e]} -> {new!r} ({op})"


def m_st_header(rng, ctx):
    f = _pick_weight_file(rng, ctx, ctx.st_files())
    b, n, h = st_read(f)
    op = rng.choice(["no-metadata", "format-tf", "metadata-list", "metadata-number-value", "junk-key",
                     "len-1", "len+1", "len-huge", "len-zero", "not-object", "dup-key"])
    raw = None
    if op == "no-metadata":
        h.pop("__metadata__", None)
    elif op == "format-tf":
        h["__metadata__"] = {"format": "tf"}
    elif op == "metadata-list":
        h["__metadata__"] = ["pt"]
    elif op == "metadata-number-value":
        h["__metadata__"] = {"format": 5}
    elif op == "junk-key":
        h["junk"] = 5
    elif op == "not-object":
        raw = b"[]"
    elif op == "dup-key":
        names = st_tensors(h)
        if len(names) < 2:
            raise Skip("one tensor")
        a, c = rng.sample(names, 2)
        text = json.dumps(h, separators=(",", ":"))
        raw = text.replace(json.dumps(c) + ":", json.dumps(a) + ":", 1).encode()
        op += f" ({c} renamed to {a}, JSON now has {a} twice)"
    else:
        data = bytearray(b)
        new = {"len-1": n - 1, "len+1": n + 1, "len-huge": 2**63, "len-zero": 0}[op]
        data[:8] = struct.pack("<Q", new)
        f.write_bytes(data)
        return f"safetensors {ctx.rel(f)}: header length {n} -> {new}"
    _st_write_header(f, b, n, h, raw)
    return f"safetensors {ctx.rel(f)}: header edit {op}"


def m_st_rename(rng, ctx):
    f, b, n, h, name = _st_pick(rng, ctx)
    op = rng.choice(["suffix", "empty", "layer99", "unknown-module"])
    if op == "suffix":
        new = name + "x"
    elif op == "empty":
        new = ""
    elif op == "layer99":
        new = re.sub(r"layers\.\d+\.", "layers.99.", name) if "layers." in name else "model.layers.99." + name
    else:
        new = name.replace(".", ".fuzzed_", 1) if "." in name else "fuzzed." + name
    if new in h:
        raise Skip("name taken")
    h[new] = h.pop(name)
    _st_write_header(f, b, n, h)
    return f"safetensors {ctx.rel(f)}: rename tensor {name} -> {new!r}"


_META_SUFFIXES = {"nbits", "group_size", "shape", "axis", "packing", "unpack_view_dtype", "view_as_float",
                  "quant_scale", "quant_zero", "compute_dtype", "offload_meta", "encoded_state_dict",
                  "stores_quant_config", "channel_wise", "optimize", "round_zero", "format", "major", "minor",
                  "patch", "bits", "dtype", "group", "tag"}


def m_st_scalar(rng, ctx):
    """Overwrite the value of a small tensor (hqq's encoded nbits/shape/packing, UQFF version and tags)."""
    f, b, n, h, name = _st_pick(rng, ctx, small=True)
    info = h[name]
    dt = info["dtype"]
    s, e = info["data_offsets"]
    fmt = ST_FMT[dt]
    count = (e - s) // ST_ITEMSIZE[dt]
    if count == 0:
        raise Skip("empty tensor")
    data = bytearray(b)
    i = rng.randrange(count)
    if fmt in "fd":
        value = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30])
    else:
        bits = ST_ITEMSIZE[dt] * 8
        signed = fmt.islower()
        choices = [0, 1, 2, 9, 2**(bits - 1) - 1] + ([-1, -2**(bits - 1)] if signed else [2**bits - 1, 255 % 2**bits])
        old = struct.unpack_from("<" + fmt, data, 8 + n + s + i * ST_ITEMSIZE[dt])[0]
        value = rng.choice([c for c in choices if c != old] or [0])
    struct.pack_into("<" + fmt, data, 8 + n + s + i * ST_ITEMSIZE[dt], value)
    f.write_bytes(data)
    # a header-like value (hqq's nbits/shape/packing..., UQFF's tags and version) is structure; an element of
    # a small weight tensor (a qzeros of 4x8) is data
    # a small float tensor set to a finite value is a scale (ModelOpt's per-tensor weight_scale_2, FP8's
    # per-tensor scale): data -- zero is what a producer writes for an all-zero weight, and any finite value is a
    # valid checkpoint's -- while NaN / inf must be refused, so those stay structural
    ctx.structural = (name.rpartition(".")[2] in _META_SUFFIXES
                      or (count <= 4 and (fmt not in "fd" or not math.isfinite(value))))
    same = ""
    if name.endswith(".weight.dtype") and fmt not in "fd" and f"{name[:-len('.dtype')]}.shape" in h:
        # a UQFF GGUF-block layer's ggml type changed to one of the same size (Q4_K <-> Q4_0 <-> IQ4_NL): its
        # blocks then mean other values, undetectable like flipped data (see m_gguf_tensor_raw)
        sh = h[f"{name[:-len('.dtype')]}.shape"]
        o, _ = sh["data_offsets"]
        dims = list(struct.unpack_from(f"<{(sh['data_offsets'][1] - o) // 4}I", b, 8 + n + o))[::-1]
        if _gguf_nbytes(dims, value) is not None and _gguf_nbytes(dims, value) == _gguf_nbytes(dims, old):
            ctx.structural, same = False, " (same size)"
    return f"safetensors {ctx.rel(f)}: element {i} of small tensor {name} ({dt}{info['shape']}) -> {value!r}{same}"


# -- GGUF edits -------------------------------------------------------------------------------------------------

def _gguf(ctx) -> tuple[Path, Gguf]:
    f = ctx.input if ctx.input.suffix == ".gguf" else next((p for p in ctx.weights() if p.suffix == ".gguf"), None)
    if f is None or not f.exists():
        raise Skip("no gguf")
    return f, Gguf(f.read_bytes())


def _pick_kv(rng, g: Gguf, want=None) -> GKv:
    kvs = [kv for kv in g.kvs if want is None or want(kv)]
    if not kvs:
        raise Skip("no such kv")
    arch = next((kv.payload for kv in g.kvs if kv.key == b"general.architecture"), b"llama")
    hot = [kv for kv in kvs if kv.key.startswith(arch + b".") or kv.key in (
        b"general.architecture", b"general.alignment", b"tokenizer.ggml.model", b"tokenizer.ggml.tokens",
        b"tokenizer.ggml.merges", b"tokenizer.ggml.token_type", b"tokenizer.ggml.bos_token_id",
        b"general.file_type")]
    return _pick(rng, hot if hot and rng.random() < 0.6 else kvs)


def _int_candidates(fmt: str, old: int) -> list[int]:
    bits = struct.calcsize(fmt) * 8
    mask = (1 << bits) - 1
    vals = [0, 1, -1, 2**31, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**63, -2**(bits - 1), old * 2, old + 1, old - 1]
    out = []
    for v in vals:
        v &= mask
        if fmt.islower() and v >= 1 << (bits - 1):
            v -= 1 << bits
        if v != old and v not in out:
            out.append(v)
    return out


def _weird_scalar(rng, vtype: int, old):
    fmt = G_SCALAR[vtype]
    if fmt in "fd":
        return rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30] + ([1e300] if fmt == "d" else []))
    if vtype == 7:
        return rng.choice([2, 255])
    return rng.choice(_int_candidates(fmt, int(old)))


def m_gguf_kv_value(rng, ctx):
    f, g = _gguf(ctx)
    kv = _pick_kv(rng, g)
    key = kv.key.decode(errors="replace")
    if kv.vtype in G_SCALAR:
        new = _weird_scalar(rng, kv.vtype, kv.payload)
        data = bytearray(g.data)
        struct.pack_into("<" + G_SCALAR[kv.vtype], data, kv.value_off, new)
        f.write_bytes(data)
        return f"gguf {key}: {kv.payload!r} -> {new!r}"
    if kv.vtype == G_STRING:
        new = rng.choice([b"", b"x", b"\0", b"a" * 5000, b"\xff\xfe", b"12", kv.payload[:-1] + b"?"])
        old, kv.payload = kv.payload, new
        f.write_bytes(g.serialize())
        return f"gguf {key}: string {old[:40]!r} -> {new[:40]!r}"
    atype, items = kv.payload
    op = rng.choice(["empty", "half", "drop-one", "one-element", "extra-element"])
    if op == "empty":
        new = []
    elif op == "half":
        new = items[: len(items) // 2]
    elif op == "drop-one" and items:
        i = rng.randrange(len(items))
        new = items[:i] + items[i + 1:]
    elif op == "one-element" and items and atype in G_SCALAR:
        new = list(items)
        i = rng.randrange(len(items))
        new[i] = _weird_scalar(rng, atype, items[i])
        op += f" [{i}] {items[i]!r} -> {new[i]!r}"
    elif op == "one-element" and items and atype == G_STRING:
        new = list(items)
        i = rng.randrange(len(items))
        new[i] = rng.choice([b"", b"\xff\xfe", items[i] * 50])
        op += f" [{i}]"
    else:
        new = list(items) + [items[-1]] if items else [0]
    kv.payload = (atype, new)
    f.write_bytes(g.serialize())
    return f"gguf {key}: array of {len(items)} (type {atype}) {op} -> {len(new)} elements"


def m_gguf_kv_raw(rng, ctx):
    """Lying fixed-width fields: a value's type id, an array's element type or count, a string length."""
    f, g = _gguf(ctx)
    data = bytearray(g.data)
    op = rng.choice(["kv-type", "kv-type", "array-type", "array-count", "string-len", "key-len"])
    if op == "kv-type":
        kv = _pick_kv(rng, g)
        new = rng.choice([t for t in range(13) if t != kv.vtype] + [13, 99, 2**31, 2**32 - 1])
        struct.pack_into("<I", data, kv.type_off, new)
        desc = f"type of {kv.key.decode(errors='replace')} {kv.vtype} -> {new}"
    elif op in ("array-type", "array-count"):
        kv = _pick_kv(rng, g, lambda kv: kv.vtype == G_ARRAY)
        atype, items = kv.payload
        if op == "array-type":
            new = rng.choice([t for t in range(13) if t != atype] + [13, 99])
            struct.pack_into("<I", data, kv.value_off, new)
            desc = f"element type of array {kv.key.decode()} {atype} -> {new}"
        else:
            n = len(items)
            new = rng.choice([0, max(n - 1, 0), n + 1, 2**32, 2**62, 2**64 - 1])
            struct.pack_into("<Q", data, kv.count_off, new)
            desc = f"count of array {kv.key.decode()} {n} -> {new}"
    elif op == "string-len":
        kv = _pick_kv(rng, g, lambda kv: kv.vtype == G_STRING)
        n = len(kv.payload)
        new = rng.choice([0, max(n - 1, 0), n + 1, 2**40, 2**64 - 1])
        struct.pack_into("<Q", data, kv.value_off, new)
        desc = f"string length of {kv.key.decode()} {n} -> {new}"
    else:
        kv = _pick_kv(rng, g)
        new = rng.choice([0, len(kv.key) + 1, 2**40, 2**64 - 1])
        struct.pack_into("<Q", data, kv.start, new)
        desc = f"key length of {kv.key.decode()} {len(kv.key)} -> {new}"
    f.write_bytes(data)
    return f"gguf raw: {desc}"


def m_gguf_kv_edit(rng, ctx):
    """Delete, duplicate or retype a metadata key (re-serialized, consistent header)."""
    f, g = _gguf(ctx)
    kv = _pick_kv(rng, g)
    key = kv.key.decode(errors="replace")
    op = rng.choice(["delete", "delete", "duplicate", "as-string", "as-array", "as-u64", "as-f32"])
    kvs = list(g.kvs)
    i = kvs.index(kv)
    if op == "delete":
        del kvs[i]
    elif op == "duplicate":
        kvs.insert(i + 1, GKv(kv.key, kv.vtype, kv.payload, 0, 0, 0, 0))
    elif op == "as-string":
        kvs[i] = GKv(kv.key, G_STRING, b"12", 0, 0, 0, 0)
    elif op == "as-array":
        kvs[i] = GKv(kv.key, G_ARRAY, (4, [1, 2]), 0, 0, 0, 0)
    elif op == "as-u64":
        kvs[i] = GKv(kv.key, 10, 2**40, 0, 0, 0, 0)
    else:
        kvs[i] = GKv(kv.key, 6, 1.5, 0, 0, 0, 0)
    f.write_bytes(g.serialize(kvs=kvs))
    return f"gguf {key}: {op}"


def _gguf_nbytes(dims, ttype: int):
    """Bytes a tensor of these dims takes as ggml type `ttype` (gguf-py's sizes), None when unknown or ragged."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in dims:
        n *= d
    if not dims or dims[0] % block:
        return None
    return n // block * nbytes


def m_gguf_tensor_raw(rng, ctx):
    f, g = _gguf(ctx)
    t = _pick(rng, g.tensors, "tensor")
    name = t.name.decode(errors="replace")
    data = bytearray(g.data)
    op = rng.choice(["dim", "dim", "swap-dims", "double-halve", "ndims", "type", "type", "offset", "offset",
                     "name-len"])
    if op == "dim":
        i = rng.randrange(len(t.dims)) if t.dims else 0
        if not t.dims:
            raise Skip("0-d")
        new = rng.choice([0, 1, 2**31, 2**32, 2**63, 2**64 - 1, t.dims[i] * 2] + ([t.dims[i] // 2] if t.dims[i] % 2 == 0 else []))
        struct.pack_into("<Q", data, t.dims_off + 8 * i, new)
        desc = f"dim {i} {t.dims[i]} -> {new}"
    elif op == "swap-dims":
        if len(t.dims) < 2 or t.dims[0] == t.dims[1]:
            raise Skip("not 2-d")
        struct.pack_into("<QQ", data, t.dims_off, t.dims[1], t.dims[0])
        desc = f"dims {t.dims} -> {t.dims[::-1]}"
    elif op == "double-halve":
        if len(t.dims) < 2 or t.dims[1] % 2:
            raise Skip("odd")
        struct.pack_into("<QQ", data, t.dims_off, t.dims[0] * 2, t.dims[1] // 2)
        desc = f"dims {t.dims} -> {[t.dims[0] * 2, t.dims[1] // 2] + t.dims[2:]}"
    elif op == "ndims":
        new = rng.choice([n for n in (0, 1, 3, 4, 5, 2**31) if n != len(t.dims)])
        struct.pack_into("<I", data, t.ndims_off, new)
        desc = f"n_dims {len(t.dims)} -> {new}"
    elif op == "type":
        new = rng.choice([x for x in (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 20, 30, 39, 4, 99, 2**31)
                          if x != t.ttype])
        struct.pack_into("<I", data, t.type_off, new)
        desc = f"type {t.ttype} -> {new}"
        if _gguf_nbytes(t.dims, new) == _gguf_nbytes(t.dims, t.ttype):
            # a type of the same size (Q4_K <-> Q4_0 <-> IQ4_NL at 4.5 bits, F16 <-> BF16): the file is a valid
            # GGUF whose bytes mean other values, as undetectable as flipped data bytes (GGUF holds no checksum)
            ctx.structural = False
            desc += " (same size)"
    elif op == "offset":
        others = [o.offset for o in g.tensors if o is not t]
        new = rng.choice([t.offset + 1, t.offset + g.alignment, max(t.offset - g.alignment, 0), 0,
                          len(g.data), 2**63, 2**64 - 1] + others[:3])
        if new == t.offset:
            new = t.offset + 1
        struct.pack_into("<Q", data, t.offset_off, new)
        desc = f"offset {t.offset} -> {new}"
    else:
        new = rng.choice([0, len(t.name) + 1, 2**40, 2**64 - 1])
        struct.pack_into("<Q", data, t.start, new)
        desc = f"name length {len(t.name)} -> {new}"
    f.write_bytes(data)
    return f"gguf tensor {name}: {desc}"


def m_gguf_tensor_edit(rng, ctx):
    """Remove or rename a tensor info (re-serialized, consistent header)."""
    f, g = _gguf(ctx)
    t = _pick(rng, g.tensors, "tensor")
    name = t.name.decode(errors="replace")
    tensors = list(g.tensors)
    i = tensors.index(t)
    op = rng.choice(["remove", "remove", "rename-unknown", "rename-layer99", "rename-dup", "rename-empty"])
    if op == "remove":
        del tensors[i]
    else:
        if op == "rename-unknown":
            new = t.name.replace(b".weight", b"x.weight") if b".weight" in t.name else t.name + b"x"
        elif op == "rename-layer99":
            new = re.sub(rb"blk\.\d+\.", b"blk.99.", t.name) if t.name.startswith(b"blk.") else b"blk.99." + t.name
        elif op == "rename-dup":
            new = _pick(rng, [o.name for o in tensors if o is not t] or [t.name])
        else:
            new = b""
        tensors[i] = GTensor(new, t.dims, t.ttype, t.offset, 0, 0, 0, 0, 0, 0)
        op += f" -> {new.decode(errors='replace')!r}"
    f.write_bytes(g.serialize(tensors=tensors))
    return f"gguf tensor {name}: {op}"


def m_gguf_counts(rng, ctx):
    f, g = _gguf(ctx)
    data = bytearray(g.data)
    op = rng.choice(["tensors", "kvs", "version"])
    if op == "tensors":
        new = rng.choice([g.n_tensors + 1, g.n_tensors - 1, 0, 2**32, 2**63])
        struct.pack_into("<Q", data, 8, new)
        desc = f"tensor count {g.n_tensors} -> {new}"
    elif op == "kvs":
        new = rng.choice([g.n_kv + 1, g.n_kv - 1, 0, 2**32, 2**63])
        struct.pack_into("<Q", data, 16, new)
        desc = f"kv count {g.n_kv} -> {new}"
    else:
        new = rng.choice([0, 1, 2, 4, 2**31])
        struct.pack_into("<I", data, 4, new)
        desc = f"version {g.version} -> {new}"
    f.write_bytes(data)
    return f"gguf header: {desc}"


def m_gguf_split(rng, ctx):
    """A split-file name without its parts, a duplicated part, or a one-part split (valid: same output)."""
    f, g = _gguf(ctx)
    op = rng.choice(["missing-part", "same-part-twice", "one-of-one"])
    if op == "missing-part":
        new = f.with_name("model-00001-of-00002.gguf")
        f.rename(new)
    elif op == "same-part-twice":
        new = f.with_name("model-00001-of-00002.gguf")
        shutil.copy(f, f.with_name("model-00002-of-00002.gguf"))
        f.rename(new)
    else:
        new = f.with_name("model-00001-of-00001.gguf")
        f.rename(new)
    ctx.input = new
    return f"gguf file edit: {op} ({new.name})"


# -- qmodel.pt (hqq library) edits: run in the child, which may use torch ------------------------------------

PT_VALUES = [None, "x", "4", [], [1, 2], -1, 0, 2**31, 2**63 - 1, 1e300, "NaN", float("nan"), True]


def _pt_load(ctx):
    import torch

    f = ctx.root / "qmodel.pt"
    if not f.exists():
        raise Skip("no qmodel.pt")
    return f, torch.load(str(f), map_location="cpu", weights_only=True)


def _pt_layers(data):
    return sorted(k for k, v in data.items() if isinstance(v, dict) and "W_q" in v)


def m_pt_value(rng, ctx):
    import torch

    f, data = _pt_load(ctx)
    module = _pick(rng, _pt_layers(data), "layer")
    state = data[module]
    target = state["meta"] if isinstance(state.get("meta"), dict) else state
    keys = sorted(k for k in target if k not in ("W_q", "bias", "scale", "zero"))
    key = _pick(rng, keys, "key")
    old = target[key]
    new = rng.choice(PT_VALUES + [torch.float64, torch.Size([0]), torch.Size([2**31, 2])])
    target[key] = new
    torch.save(data, str(f))
    return f"qmodel.pt {module}.{key}: {old!r} -> {new!r}"[:300]


def m_pt_delete_key(rng, ctx):
    import torch

    f, data = _pt_load(ctx)
    module = _pick(rng, _pt_layers(data), "layer")
    state = data[module]
    target = state["meta"] if isinstance(state.get("meta"), dict) and rng.random() < 0.7 else state
    key = _pick(rng, sorted(target), "key")
    del target[key]
    torch.save(data, str(f))
    return f"qmodel.pt {module}: delete {'meta.' if target is not state else ''}{key}"


def m_pt_tensor(rng, ctx):
    import torch

    f, data = _pt_load(ctx)
    module = _pick(rng, _pt_layers(data), "layer")
    state = data[module]
    meta = state["meta"] if isinstance(state.get("meta"), dict) else state
    op = rng.choice(["W_q-float", "W_q-half-rows", "W_q-empty", "scale-drop-row", "zero-int64", "scale-0d",
                     "W_q-3d", "bias-wrong-length", "scale-transposed"])
    if op == "W_q-float":
        state["W_q"] = state["W_q"].float()
    elif op == "W_q-half-rows":
        state["W_q"] = state["W_q"][: max(state["W_q"].shape[0] // 2, 1)].clone()
    elif op == "W_q-empty":
        state["W_q"] = state["W_q"][:0].clone()
    elif op == "W_q-3d":
        state["W_q"] = state["W_q"].unsqueeze(0).clone()
    elif op == "scale-drop-row" and isinstance(meta.get("scale"), torch.Tensor) and meta["scale"].dim():
        meta["scale"] = meta["scale"][:-1].clone()
    elif op == "zero-int64" and isinstance(meta.get("zero"), torch.Tensor):
        meta["zero"] = meta["zero"].to(torch.int64)
    elif op == "scale-0d" and isinstance(meta.get("scale"), torch.Tensor):
        meta["scale"] = meta["scale"].reshape(-1)[0].clone()
    elif op == "scale-transposed" and isinstance(meta.get("scale"), torch.Tensor) and meta["scale"].dim() == 2:
        meta["scale"] = meta["scale"].t().contiguous()
    else:
        state["bias"] = torch.zeros(3)
        op = "bias-wrong-length"
    torch.save(data, str(f))
    return f"qmodel.pt {module}: {op}"


def m_pt_structure(rng, ctx):
    import torch

    f, data = _pt_load(ctx)
    op = rng.choice(["remove-layer", "remove-dense", "add-layer99", "add-junk-layer", "top-list", "top-tensor",
                     "module-not-dict", "legacy-container"])
    layers = _pt_layers(data)
    if op == "remove-layer":
        m = _pick(rng, layers, "layer")
        del data[m]
        op += f" {m}"
    elif op == "remove-dense":
        m = _pick(rng, [k for k in data if k not in layers], "dense entry")
        del data[m]
        op += f" {m}"
    elif op == "add-layer99":
        m = _pick(rng, layers, "layer")
        data[re.sub(r"layers\.\d+\.", "layers.99.", m) if "layers." in m else m + "_99"] = data[m]
    elif op == "add-junk-layer":
        data["model.layers.0.mlp.fuzz_proj"] = {"W_q": torch.zeros(2, 2, dtype=torch.uint8)}
    elif op == "top-list":
        data = list(data.values())
    elif op == "top-tensor":
        data = torch.zeros(3)
    elif op == "module-not-dict":
        m = _pick(rng, sorted(data), "entry")
        data[m] = torch.zeros(2)
        op += f" {m}"
    if op == "legacy-container":  # the same dict in torch's pre-1.6 format: the same model
        torch.save(data, str(f), _use_new_zipfile_serialization=False)
    else:
        torch.save(data, str(f))
    return f"qmodel.pt structure: {op}"


def m_pt_unsafe_pickle(rng, ctx):
    """data.pkl replaced by a pickle asking for a global that is not a tensor (weights_only must refuse)."""
    f = ctx.root / "qmodel.pt"
    if not f.exists() or not zipfile.is_zipfile(f):
        raise Skip("no zip qmodel.pt")
    payload = rng.choice([b"cposix\nsystem\n(S'true'\ntR.", b"cbuiltins\neval\n(S'1'\ntR.",
                          b"ccollections\nCounter\n)R."])
    tmp = f.with_suffix(".tmp")
    with zipfile.ZipFile(f) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, payload if info.filename.endswith("data.pkl") else zin.read(info))
    tmp.replace(f)
    return f"qmodel.pt: data.pkl replaced by a pickle calling {payload.split(b'(')[0].split(b')')[0]!r}"


# -- JSON config edits ----------------------------------------------------------------------------------------

CFG_VALUES = [None, "", "x", "4", [], [1, 2], {}, -1, 0, 2**31, 2**63, 1e300, -1e300, "NaN", "Infinity", "-inf", 1.5]
_RAW = "@@FUZZ_RAW@@"
# quantization_config keys whose deletion (or these values) leaves a valid checkpoint of another setting, which
# the producer's own loader reads as qconvert reads it, and which no byte of the file can reveal: counted with
# the F16 <-> BF16 relabels (`changed`), not as silent. Each was found by a long run (seed 2029):
# - gptqmodel's `rotation` (gptq case 6759): without it the checkpoint is unrotated GPTQ; gptqmodel keys its
#   online Hadamard on qcfg.rotation alone (models/loader.py _setup_rotation_online_had), and null / "" are none;
# - auto-round's `packing_format` (auto-round case 8106): transformers' AutoRoundConfig defaults it to
#   "auto_round:gptq", which auto-round's loader reads as auto_gptq (zero points stored minus one); a raw-zero
#   "auto_round" file whose zeros never reach the field's maximum is a valid file of that packing (one that does
#   is refused: a stored maximum would read 2**bits)
_SILENT_DEFAULTS = {"rotation": (None, ""), "packing_format": ()}


def _pick_json(rng, ctx) -> Path:
    files = [p for p in ctx.jsons() if p.stat().st_size < 64 * MB]
    if not files:
        raise Skip("no json")
    weights = [{"config.json": 5, "quantize_config.json": 4, "tokenizer.json": 2,
                "model.safetensors.index.json": 3}.get(p.name, 1) for p in files]
    return rng.choices(files, weights)[0]


def _json_path(rng, obj) -> list:
    """A random path into a JSON value (at least one step; [] for a scalar document)."""
    path, cur = [], obj
    while isinstance(cur, (dict, list)) and cur:
        keys = list(cur) if isinstance(cur, dict) else list(range(len(cur)))
        if isinstance(cur, dict) and path == [] and "quantization_config" in cur and rng.random() < 0.4:
            k = "quantization_config"
        else:
            k = keys[rng.randrange(len(keys))]
        path.append(k)
        cur = cur[k]
        if not isinstance(cur, (dict, list)) or rng.random() < 0.35:
            break
    return path


def _at(obj, path):
    for k in path[:-1]:
        obj = obj[k]
    return obj


def _show_path(path) -> str:
    return ".".join(str(k) for k in path) or "<document>"


def m_cfg(rng, ctx):
    f = _pick_json(rng, ctx)
    obj = json.loads(f.read_text())
    op = rng.choice(["delete", "delete", "value", "value", "value", "nest", "huge-number", "raw-literal"])
    path = _json_path(rng, obj)
    if not path:
        raise Skip("empty document")
    parent = _at(obj, path)
    old = parent[path[-1]]
    raw = None
    if op == "delete":
        del parent[path[-1]]
        desc = "delete"
    elif op == "value":
        new = rng.choice(CFG_VALUES)
        parent[path[-1]] = new
        desc = f"{json.dumps(old)[:40]} -> {json.dumps(new)}"
    elif op == "nest":
        depth = rng.choice([65, 2000, 200000])
        raw = "[" * depth + "]" * depth
        desc = f"-> list nested {depth} deep"
    elif op == "huge-number":
        raw = rng.choice(["9" * rng.choice([30, 400, 5000]), "1e99999", "-1e400", "1" + "0" * 20 + ".5"])
        desc = f"-> number literal of {len(raw)} characters ({raw[:12]}...)"
    else:
        raw = rng.choice(["NaN", "Infinity", "-Infinity"])
        desc = f"-> bare {raw}"
    if path[-1] in _SILENT_DEFAULTS and (op == "delete" or (op == "value" and new in _SILENT_DEFAULTS[path[-1]])):
        ctx.structural = False  # the producer's own loader reads the file as qconvert does: see _SILENT_DEFAULTS
    if raw is not None:
        parent[path[-1]] = _RAW
    text = json.dumps(obj, indent=2)
    if raw is not None:
        text = text.replace(json.dumps(_RAW), raw, 1)
    f.write_text(text)
    return f"config {ctx.rel(f)} {_show_path(path)}: {desc}"


def m_cfg_file(rng, ctx):
    f = _pick_json(rng, ctx)
    data = f.read_bytes()
    op = rng.choice(["empty", "null", "array", "string", "truncated", "not-utf8", "bom", "two-documents"])
    new = {"empty": b"", "null": b"null", "array": b"[]", "string": b'"config"',
           "truncated": data[: rng.randrange(1, max(2, len(data)))], "not-utf8": b"\xff\xfe" + data,
           "bom": b"\xef\xbb\xbf" + data, "two-documents": data + b"\n{}"}[op]
    f.write_bytes(new)
    return f"config file {ctx.rel(f)}: {op}"


# -- file edits -------------------------------------------------------------------------------------------------

def _module_of(name: str) -> str:
    if ".weight." in name or name.endswith(".weight"):
        return name.split(".weight")[0]
    return name.rpartition(".")[0]


def m_rm_tensor(rng, ctx):
    f, b, n, h, name = _st_pick(rng, ctx)
    st_remove(f, {name})
    return f"remove tensor {name} from {ctx.rel(f)}"


def m_rm_partner(rng, ctx):
    groups: dict[tuple[Path, str], list[str]] = {}
    for f in ctx.st_files():
        for name in st_tensors(st_read(f)[2]):
            groups.setdefault((f, _module_of(name)), []).append(name)
    multi = [k for k, v in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])) if len(v) > 1]
    f, module = _pick(rng, multi, "module with partner tensors")
    name = _pick(rng, sorted(groups[(f, module)]))
    st_remove(f, {name})
    return f"remove partner tensor {name} (module {module} keeps {len(groups[(f, module)]) - 1}) from {ctx.rel(f)}"


def m_rm_file(rng, ctx):
    files = [p for p in ctx.files() if p != ctx.input]
    weights = ctx.weights()
    if len(weights) > 1 and rng.random() < 0.3:
        files = weights
    f = _pick(rng, files, "file to remove")
    f.unlink()
    return f"remove file {ctx.rel(f)}"


def m_add_stray(rng, ctx):
    if ctx.input.is_file():
        raise Skip("file input")
    op = rng.choice(["notes.txt", "copy-shard", "junk.safetensors", "empty.safetensors", "sub/model.safetensors",
                     "index-missing-one", "stray-uqff", "junk-qmodel"])
    weights = ctx.weights()
    if op == "notes.txt":
        (ctx.root / "notes.txt").write_text("fuzz\n")
    elif op == "copy-shard":
        src = _pick(rng, [p for p in weights if p.suffix in (".safetensors", ".uqff")], "shard")
        dst = src.with_name(("extra-" + src.name) if src.suffix == ".safetensors" else "extra-0.uqff")
        shutil.copy(src, dst)
        op += f" {src.name} -> {dst.name}"
    elif op == "junk.safetensors":
        (ctx.root / "junk.safetensors").write_bytes(bytes(rng.randrange(256) for _ in range(1000)))
    elif op == "empty.safetensors":
        (ctx.root / "empty.safetensors").write_bytes(b"")
    elif op == "sub/model.safetensors":
        src = _pick(rng, [p for p in weights if p.suffix == ".safetensors"], "safetensors file")
        (ctx.root / "sub").mkdir()
        shutil.copy(src, ctx.root / "sub" / "model.safetensors")
    elif op == "index-missing-one":
        idx = ctx.root / "model.safetensors.index.json"
        shards = [p for p in weights if p.suffix == ".safetensors" and p.parent == ctx.root]
        if idx.exists() or not shards:
            raise Skip("has an index")
        wm = {k: p.name for p in shards for k in st_tensors(st_read(p)[2])}
        gone = _pick(rng, sorted(wm))
        del wm[gone]
        idx.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        op += f" (index omits {gone})"
    elif op == "stray-uqff":
        (ctx.root / "stray-0.uqff").write_bytes(st_pack({}, b""))
    else:
        (ctx.root / "qmodel.pt").write_bytes(b"PK\x03\x04junk")
    return f"add stray file: {op}"


@dataclass
class Mutation:
    fn: object
    weight: float
    applies: object  # (ctx) -> bool


def m_canary_swap(rng, ctx):
    """The oracle's own test (never drawn: weight 0, run with --mutations canary): swap the bytes of two
    tensors of one dtype and shape whose values differ, leaving every header as it was, and call it
    structural. A reader cannot tell, so the case exits 0 with two tensors' values exchanged: exactly what a
    reader that silently misreads a valid-looking input produces, which the oracle must count as `silent`."""
    f = _pick_weight_file(rng, ctx, [p for p in ctx.weights() if p.suffix in (".safetensors", ".gguf")])
    b = f.read_bytes()
    if f.suffix == ".gguf":
        g = Gguf(b)
        spans = {}
        ts = sorted(g.tensors, key=lambda t: t.offset)
        for i, t in enumerate(ts[:-1]):
            spans[t.name.decode("utf-8", "replace")] = ((t.ttype, tuple(t.dims)), g.data_start + t.offset,
                                                        g.data_start + ts[i + 1].offset)
    else:
        _, n, h = st_read(f)
        spans = {k: ((h[k]["dtype"], tuple(h[k]["shape"])), 8 + n + h[k]["data_offsets"][0],
                     8 + n + h[k]["data_offsets"][1]) for k in st_tensors(h)}
    pairs = [(a, c) for a in sorted(spans) for c in sorted(spans) if a < c and spans[a][0] == spans[c][0]
             and spans[a][2] - spans[a][1] == spans[c][2] - spans[c][1] > 0
             and b[spans[a][1]:spans[a][2]] != b[spans[c][1]:spans[c][2]]]
    a, c = _pick(rng, pairs, "pair of like tensors")
    (_, s1, e1), (_, s2, e2) = spans[a], spans[c]
    data = bytearray(b)
    data[s1:e1], data[s2:e2] = b[s2:e2], b[s1:e1]
    f.write_bytes(data)
    return f"canary: {ctx.rel(f)}: the bytes of {a} and {c} swapped (headers unchanged)"


def _has_st(ctx):
    return bool(ctx.st_files())


def _has_gguf(ctx):
    return any(p.suffix == ".gguf" for p in ctx.weights())


def _has_pt(ctx):
    return (ctx.root / "qmodel.pt").exists()


def _any(ctx):
    return True


def _has_json(ctx):
    return bool(ctx.jsons())


MUTATIONS = {
    "truncate": Mutation(m_truncate, 6, _any),
    "truncate-boundary": Mutation(m_truncate_boundary, 6, _any),
    "flip": Mutation(m_flip, 6, _any),
    "flip-header": Mutation(m_flip_header, 8, _any),
    "st-dtype": Mutation(m_st_dtype, 4, _has_st),
    "st-shape": Mutation(m_st_shape, 4, _has_st),
    "st-offsets": Mutation(m_st_offsets, 4, _has_st),
    "st-header": Mutation(m_st_header, 3, _has_st),
    "st-rename": Mutation(m_st_rename, 2, _has_st),
    "st-scalar": Mutation(m_st_scalar, 3, _has_st),
    "gguf-kv-value": Mutation(m_gguf_kv_value, 8, _has_gguf),
    "gguf-kv-raw": Mutation(m_gguf_kv_raw, 5, _has_gguf),
    "gguf-kv-edit": Mutation(m_gguf_kv_edit, 6, _has_gguf),
    "gguf-tensor-raw": Mutation(m_gguf_tensor_raw, 8, _has_gguf),
    "gguf-tensor-edit": Mutation(m_gguf_tensor_edit, 4, _has_gguf),
    "gguf-counts": Mutation(m_gguf_counts, 3, _has_gguf),
    "gguf-split": Mutation(m_gguf_split, 1, _has_gguf),
    "pt-value": Mutation(m_pt_value, 6, _has_pt),
    "pt-delete-key": Mutation(m_pt_delete_key, 4, _has_pt),
    "pt-tensor": Mutation(m_pt_tensor, 5, _has_pt),
    "pt-structure": Mutation(m_pt_structure, 4, _has_pt),
    "pt-unsafe-pickle": Mutation(m_pt_unsafe_pickle, 1, _has_pt),
    "cfg": Mutation(m_cfg, 8, _has_json),
    "cfg-file": Mutation(m_cfg_file, 2, _has_json),
    "rm-tensor": Mutation(m_rm_tensor, 3, _has_st),
    "rm-partner": Mutation(m_rm_partner, 3, _has_st),
    "rm-file": Mutation(m_rm_file, 2, _any),
    "add-stray": Mutation(m_add_stray, 2, lambda ctx: ctx.input.is_dir()),
    "canary-swap": Mutation(m_canary_swap, 0, _any),  # the oracle's test: only with --mutations canary
}


def apply_mutation(rng: random.Random, ctx: Ctx, only: re.Pattern | None = None) -> tuple[str, str]:
    """(kind, description): the first applicable mutation drawn (up to 20 tries)."""
    kinds = [k for k, m in MUTATIONS.items() if m.applies(ctx) and (only is None or only.search(k))]
    if not kinds:
        raise Skip("no mutation applies")
    for _ in range(20):
        weights = [MUTATIONS[k].weight for k in kinds]
        kind = rng.choices(kinds, weights if any(weights) else None)[0]  # only weight-0 kinds: chosen by --mutations
        ctx.structural = True
        try:
            return kind, MUTATIONS[kind].fn(rng, ctx)
        except Skip:
            continue
    raise Skip("no mutation applied in 20 tries")
