#!/usr/bin/env python
"""Fuzz every qconvert reader with seeded mutations of real checkpoints, run as a user runs qconvert.

    python scripts/fuzz.py [--readers gptq,gguf,...] [--cases N] [--seed S] [--jobs J] [--timeout T]
                           [--findings F.jsonl] [--report-md F.md] [--keep DIR] [--work DIR]
    python scripts/fuzz.py --replay CASE.json          (or --replay '{"reader": ..., "seed": ..., ...}')

Seeds are the test fixtures (tests/_fixtures: gptqmodel GPTQ/QQQ checkpoints, hqq's transformers safetensors
and qmodel.pt folders, mistral.rs UQFF folders, the dense base models) and GGUFs written by
`qconvert gptq->gguf` / `hf->gguf` and, when llama-cpp-python is installed, by llama.cpp's own
`llama_model_quantize` (cached under --work). Each case copies one seed, applies one mutation (truncation,
byte flips, structured header / metadata / config / file edits) and runs `qconvert inspect PATH` and
`qconvert 'FMT->hf' PATH OUT --type f32 --quiet` through `qconvert.converters.apps.cli.main` in a forked child of
this process (which imported qconvert once and never runs a torch op itself), with its fd 1/2 in files,
one torch thread, a time bound (--timeout) and a memory bound (RLIMIT_AS = VmSize + max(512 MB, 8 x input
bytes); the peak RSS growth is read too).

Outcomes:
  ok             exit 0
  refused        exit 2, exactly one stderr line `qconvert: error: ...` naming a file of the input, nothing at OUT
  bad-refusal    exit 2 but several lines, no input file named, library text quoted (`IndexError:`, ...), or
                 output / temporaries left behind
  warning-first  something on stderr before the error line
  traceback      any other exit (an uncaught exception, a crash by signal)
  hang           over the time bound
  alloc          over the memory bound (MemoryError, allocator failures, RSS growth)
  silent         a structural mutation (header / metadata / config / file edit, truncation; not a data-byte
                 flip) that exits 0 with converted tensors that differ from the seed's conversion (names,
                 dtypes, shapes, bytes)
  noisy          exit 0 with something on stderr (informational)

A case is reproducible from (reader, seed name, case number, master seed): the seed is drawn with
Random("master:reader:case") and the mutation with Random("master:reader:case:seed").
"""

from __future__ import annotations

import os

for _k, _v in {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "QCONVERT_THREADS": "1",
               "QCONVERT_COMPILE": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "GPTQMODEL_CPU_WORKERS": "2"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zipfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "_fixtures"
DEFAULT_WORK = Path(tempfile.gettempdir()) / f"qconvert-fuzz-{os.getuid()}"
OUTCOMES = ("skipped", "ok", "refused", "noisy", "silent", "warning-first", "bad-refusal", "traceback", "hang", "alloc",
            "error")
SEVERITY = {o: i for i, o in enumerate(OUTCOMES)}
FINDING_OUTCOMES = ("silent", "warning-first", "bad-refusal", "traceback", "hang", "alloc", "noisy", "error")
MB = 1024 * 1024

READERS = {  # reader -> the format name the CLI is given
    "gptq": "gptq", "gptq-v2": "gptq-v2", "qqq": "qqq", "hqq": "hqq", "hqq-pt": "hqq", "gguf": "gguf",
    "uqff": "uqff", "hf": "hf",
}


# ==============================================================================================================
# seeds


@dataclass
class Seed:
    name: str
    path: Path  # a folder, or a file (gguf)
    kind: str = "dir"  # "dir" | "file"


def _done(d: Path) -> bool:
    return (d / ".done").exists()


def _fixture_seeds(reader: str) -> list[Seed]:
    out = []
    if reader in ("gptq", "gptq-v2"):
        want = "gptq_v2" if reader == "gptq-v2" else "gptq"
        for d in sorted(FIXTURES.glob("v[12]_*")):
            if _done(d) and (d / "ckpt").is_dir():
                fmt = json.loads((d / ".done").read_text()).get("fmt")
                if fmt == want:
                    out.append(Seed(d.name, d / "ckpt"))
        rot = FIXTURES / "qqq" / "rot_b4_g128"
        if reader == "gptq" and _done(rot):
            out.append(Seed("rot_b4_g128", rot / "ckpt"))
    elif reader == "qqq":
        for d in sorted((FIXTURES / "qqq").glob("qqq_*")):
            if _done(d):
                out.append(Seed(d.name, d / "ckpt"))
    elif reader in ("hqq", "hqq-pt"):
        sub = "tf" if reader == "hqq" else "lib"
        for d in sorted((FIXTURES / "hqq").iterdir() if (FIXTURES / "hqq").is_dir() else []):
            if _done(d) and (d / sub).is_dir() and not d.name.startswith("base_"):
                out.append(Seed(f"{d.name}/{sub}", d / sub))
    elif reader == "uqff":
        for d in sorted((FIXTURES / "uqff").iterdir() if (FIXTURES / "uqff").is_dir() else []):
            if _done(d) and list(d.glob("*.uqff")):
                out.append(Seed(d.name, d))
    elif reader == "hf":
        for name, d in (("base", FIXTURES / "base"), ("hqq/base_qwen2", FIXTURES / "hqq" / "base_qwen2"),
                        ("uqff/wide", FIXTURES / "uqff" / "wide")):
            if _done(d):
                out.append(Seed(name, d))
    return out


# GGUF seeds written by qconvert (from the fixtures) and llama.cpp: name -> (source reader, fixture, argv tail)
def gguf_builds() -> dict:
    return {"qconvert-q4_0": ("gptq", FIXTURES / "v1_b4_g32_sym" / "ckpt", []),
            "qconvert-q4_1": ("gptq", FIXTURES / "v1_b4_g32_asym_zp0" / "ckpt", []),
            "qconvert-q8_0": ("gptq", FIXTURES / "v1_b8_g128_sym" / "ckpt", []),
            "qconvert-f16": ("hf", FIXTURES / "base", ["--type", "f16"])}


LLAMA_BUILDS = {"llama-q4_k_m": 15, "llama-q6_k": 18, "llama-q2_k": 10}  # LlamaFileType, from uqff/wide as F32


def gguf_seed_dir(work: Path) -> Path:
    return work / "seeds" / "gguf"


def _gguf_seeds(work: Path) -> list[Seed]:
    d = gguf_seed_dir(work)
    out = [Seed(p.stem, p, "file") for p in sorted(d.glob("*.gguf")) if not p.stem.endswith(("-f32", ".part"))]
    made = FIXTURES / "gguf_reader"  # llama.cpp-made files of tests/test_gguf_reader.py, when it has run
    for arch, names in (("llama", ("q4_k_m", "q6_k", "q3_k_m", "q5_1", "iq4_nl")), ("qwen3", ("q4_0",))):
        if _done(made / arch):
            out += [Seed(f"gguf_reader/{arch}/{n}", made / arch / f"{n}.gguf", "file") for n in names
                    if (made / arch / f"{n}.gguf").exists()]
    return out


def seeds_for(reader: str, work: Path) -> list[Seed]:
    seeds = _gguf_seeds(work) if reader == "gguf" else _fixture_seeds(reader)
    return sorted(seeds, key=lambda s: s.name)


# ==============================================================================================================
# safetensors, GGUF and zip structure (pure Python: the parent never runs torch)

ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
ST_FMT = {"F64": "d", "F32": "f", "I64": "q", "I32": "i", "I16": "h", "I8": "b", "U64": "Q", "U32": "I",
          "U16": "H", "U8": "B", "BOOL": "B"}


def st_read(path: Path):
    b = path.read_bytes()
    n = struct.unpack_from("<Q", b, 0)[0]
    return b, n, json.loads(b[8:8 + n])


def st_pack(header: dict, data: bytes, raw_header: bytes | None = None) -> bytes:
    hb = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def st_tensors(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def st_remove(path: Path, names: set[str]) -> None:
    b, n, h = st_read(path)
    base, new, chunks, off = 8 + n, {}, [], 0
    for name in st_tensors(h):
        if name in names:
            continue
        s, e = h[name]["data_offsets"]
        new[name] = {**h[name], "data_offsets": [off, off + e - s]}
        chunks.append(b[base + s:base + e])
        off += e - s
    if "__metadata__" in h:
        new["__metadata__"] = h["__metadata__"]
    path.write_bytes(st_pack(new, b"".join(chunks)))


G_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
G_STRING, G_ARRAY = 8, 9


@dataclass
class GKv:
    key: bytes
    vtype: int
    payload: object  # scalar | bytes | (atype, [payload...])
    start: int
    end: int
    type_off: int
    value_off: int  # scalar value / string length / array element type
    count_off: int = -1  # arrays


@dataclass
class GTensor:
    name: bytes
    dims: list
    ttype: int
    offset: int
    start: int
    end: int
    ndims_off: int
    dims_off: int
    type_off: int
    offset_off: int


class Gguf:
    """A GGUF file's header parsed with every field's byte position (for raw edits) and re-serializable."""

    def __init__(self, data: bytes):
        self.data = data
        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF")
        self.version, self.n_tensors, self.n_kv = struct.unpack_from("<IQQ", data, 4)
        self.pos = 24
        self.kvs: list[GKv] = []
        for _ in range(self.n_kv):
            start = self.pos
            key = self._str()
            type_off = self.pos
            vtype = self._u("I")
            value_off = self.pos
            payload, count_off = self._value(vtype)
            self.kvs.append(GKv(key, vtype, payload, start, self.pos, type_off, value_off, count_off))
        self.tensors: list[GTensor] = []
        for _ in range(self.n_tensors):
            start = self.pos
            name = self._str()
            ndims_off = self.pos
            nd = self._u("I")
            dims_off = self.pos
            dims = [self._u("Q") for _ in range(nd)]
            type_off = self.pos
            ttype = self._u("I")
            offset_off = self.pos
            offset = self._u("Q")
            self.tensors.append(GTensor(name, dims, ttype, offset, start, self.pos, ndims_off, dims_off, type_off,
                                        offset_off))
        self.header_end = self.pos
        self.alignment = 32
        for kv in self.kvs:
            if kv.key == b"general.alignment" and kv.vtype in G_SCALAR:
                self.alignment = int(kv.payload) or 32
        self.data_start = self.header_end + (-self.header_end % self.alignment)

    def _u(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _str(self) -> bytes:
        n = self._u("Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def _value(self, vtype: int):
        if vtype in G_SCALAR:
            return self._u(G_SCALAR[vtype]), -1
        if vtype == G_STRING:
            return self._str(), -1
        if vtype == G_ARRAY:
            atype = self._u("I")
            count_off = self.pos
            n = self._u("Q")
            return (atype, [self._value(atype)[0] for _ in range(n)]), count_off
        raise ValueError(f"value type {vtype}")

    @staticmethod
    def ser_value(vtype: int, payload) -> bytes:
        if vtype in G_SCALAR:
            return struct.pack("<" + G_SCALAR[vtype], payload)
        if vtype == G_STRING:
            return struct.pack("<Q", len(payload)) + payload
        atype, items = payload
        return struct.pack("<IQ", atype, len(items)) + b"".join(Gguf.ser_value(atype, it) for it in items)

    def serialize(self, kvs=None, tensors=None, version=None) -> bytes:
        """The file with this header (kvs / tensors replaced), data section unchanged at the next alignment."""
        kvs = self.kvs if kvs is None else kvs
        tensors = self.tensors if tensors is None else tensors
        out = [b"GGUF", struct.pack("<IQQ", self.version if version is None else version, len(tensors), len(kvs))]
        for kv in kvs:
            out += [struct.pack("<Q", len(kv.key)), kv.key, struct.pack("<I", kv.vtype),
                    self.ser_value(kv.vtype, kv.payload)]
        for t in tensors:
            out += [struct.pack("<Q", len(t.name)), t.name, struct.pack("<I", len(t.dims)),
                    b"".join(struct.pack("<Q", d) for d in t.dims), struct.pack("<IQ", t.ttype, t.offset)]
        head = b"".join(out)
        return head + b"\0" * (-len(head) % self.alignment) + self.data[self.data_start:]

    def boundaries(self) -> list[int]:
        b = [4, 8, 16, 24, self.header_end, self.data_start]
        b += [kv.start for kv in self.kvs] + [t.start for t in self.tensors]
        b += [self.data_start + t.offset for t in self.tensors]
        return b


def zip_spans(path: Path) -> dict:
    """{"members": [(name, header_offset, data_start, data_end)], "central": offset} of a zip (torch.save)."""
    raw = path.read_bytes()
    members = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            fn_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
            start = info.header_offset + 30 + fn_len + extra_len
            members.append((info.filename, info.header_offset, start, start + info.compress_size))
    eocd = raw.rfind(b"PK\x05\x06")
    central = struct.unpack_from("<I", raw, eocd + 16)[0] if eocd >= 0 else len(raw)
    return {"members": members, "central": central, "eocd": eocd}


# ==============================================================================================================
# mutations: fn(rng, ctx) -> description; ctx.structural False marks a data mutation (no silent check)


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
    ctx.structural = count <= 4 or name.rpartition(".")[2] in _META_SUFFIXES
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
}


def apply_mutation(rng: random.Random, ctx: Ctx, only: re.Pattern | None = None) -> tuple[str, str]:
    """(kind, description): the first applicable mutation drawn (up to 20 tries)."""
    kinds = [k for k, m in MUTATIONS.items() if m.applies(ctx) and (only is None or only.search(k))]
    if not kinds:
        raise Skip("no mutation applies")
    for _ in range(20):
        kind = rng.choices(kinds, [MUTATIONS[k].weight for k in kinds])[0]
        ctx.structural = True
        try:
            return kind, MUTATIONS[kind].fn(rng, ctx)
        except Skip:
            continue
    raise Skip("no mutation applied in 20 tries")


# ==============================================================================================================
# the child: run qconvert as a user does


def _status(field_name: str) -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _redirect(out: Path, err: Path) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        h = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(h, fd)
        os.close(h)


def _run_cli(argv: list[str]) -> int:
    from qconvert.converters.apps.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what the interpreter would print for an uncaught exception
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return rc


def st_digest(out_dir: Path) -> dict:
    """{tensor name: [dtype, shape, sha1 of its bytes]} of every safetensors file in an hf output folder."""
    digest = {}
    for p in sorted(out_dir.glob("*.safetensors")):
        b, n, h = st_read(p)
        for name in st_tensors(h):
            s, e = h[name]["data_offsets"]
            digest[name] = [h[name]["dtype"], h[name]["shape"], hashlib.sha1(b[8 + n + s:8 + n + e]).hexdigest()]
    return digest


def compare_digests(ref: dict, got: dict) -> str | None:
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    differ = sorted(k for k in set(ref) & set(got) if ref[k] != got[k])
    if not (missing or extra or differ):
        return None
    parts = []
    for what, names in (("missing", missing), ("extra", extra), ("differ", differ)):
        if names:
            parts.append(f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return "; ".join(parts)


_KEEP_OPEN: list = []  # files faulthandler writes to (they must stay open)


def _child_setup(case_dir: Path) -> None:
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    tmp = case_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    _redirect(case_dir / "setup.out", case_dir / "setup.err")
    _KEEP_OPEN.append(open(case_dir / "crash.txt", "w"))
    faulthandler.enable(_KEEP_OPEN[-1])


def _limit_memory(bound: int) -> None:
    vm = _status("VmSize")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + bound
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def child_case(job: dict) -> int:
    case_dir = Path(job["dir"])
    _child_setup(case_dir)
    seed = Seed(job["seed_name"], Path(job["seed_path"]), job["seed_kind"])
    root = case_dir / "in"
    if seed.kind == "file":
        root.mkdir()
        shutil.copy(seed.path, root / "model.gguf")
        inp = root / "model.gguf"
    else:
        shutil.copytree(seed.path, root, ignore=shutil.ignore_patterns(".done", ".lock", "mistralrs_logprobs.json"))
        inp = root
    ctx = Ctx(root, inp, job["reader"])
    meta = {"kind": None, "mutation": None, "structural": None, "input": str(inp)}
    try:
        if job.get("mutate", True):
            rng = random.Random(f"{job['master_seed']}:{job['reader']}:{job['case']}:{seed.name}")
            only = re.compile(job["only"]) if job.get("only") else None
            meta["kind"], meta["mutation"] = apply_mutation(rng, ctx, only)
            meta["structural"] = ctx.structural
    except Skip as e:
        meta["skip"] = str(e)
    meta["input"] = str(ctx.input)
    (case_dir / "case.json").write_text(json.dumps(meta))
    if "skip" in meta:
        return 0
    import torch

    torch.set_num_threads(1)
    in_bytes = _tree_bytes(root)
    bound = max(512 * MB, 8 * in_bytes)
    res = {"in_bytes": in_bytes, "bound": bound, "commands": []}
    rss0 = _status("VmRSS")
    _reset_peak()
    _limit_memory(bound)
    _KEEP_OPEN.append(open(case_dir / "hang.txt", "w"))
    faulthandler.dump_traceback_later(job["timeout"], exit=True, file=_KEEP_OPEN[-1])
    out = case_dir / "out"
    commands = [("inspect", ["inspect", str(ctx.input)])] if job.get("inspect", True) else []
    # --allow-requant: only a rotated GPTQ's folded down_proj needs it (->hf f32 is exact otherwise); a
    # refused plan would hide what the reader does with the input
    commands.append(("convert", [f"{READERS[job['reader']]}->hf", str(ctx.input), str(out), "--type", "f32",
                                 "--allow-requant", "--quiet"]))
    if "gguf" in job.get("targets", ()):  # the GGUF writer reads what hf ignores (tokenizer, metadata)
        commands.append(("to-gguf", [f"{READERS[job['reader']]}->gguf", str(ctx.input), str(case_dir / "out.gguf"),
                                     "--type", "f16", "--allow-requant", "--quiet"]))
    for name, argv in commands:
        _redirect(case_dir / f"{name}.out", case_dir / f"{name}.err")
        t0 = time.monotonic()
        rc = _run_cli(argv)
        res["commands"].append({"name": name, "argv": argv, "rc": rc, "seconds": round(time.monotonic() - t0, 3)})
        (case_dir / "result.json").write_text(json.dumps(res))
        if rc not in (0, 2, 130):  # a bug: the CLI said so in one line; --debug gives the traceback's frames
            _redirect(case_dir / f"{name}.debug.out", case_dir / f"{name}.debug.err")
            _run_cli([a + "-debug" if a in (str(out), str(case_dir / "out.gguf")) else a for a in argv] + ["--debug"])
    faulthandler.cancel_dump_traceback_later()
    res["rss_growth"] = max(0, _status("VmHWM") - rss0)
    hf = next((c for c in res["commands"] if c["name"] == "convert"), None)
    if hf is not None and hf["rc"] == 0:
        if job.get("ref_out"):  # the seed's own conversion: keep its digest
            Path(job["ref_out"]).write_text(json.dumps(st_digest(out)))
        elif meta["structural"]:  # compared with the seed's conversion by the parent
            res["digest"] = st_digest(out)
    (case_dir / "result.json").write_text(json.dumps(res))
    return 0


def child_build_gguf(job: dict) -> int:
    """A GGUF seed: `qconvert SRC->gguf` from a fixture, or llama.cpp's quantizer on an F32 GGUF."""
    case_dir = Path(job["dir"])
    _child_setup(case_dir)
    import torch

    torch.set_num_threads(1)
    dst = Path(job["dst"])
    tmp = dst.with_name(dst.stem + ".part.gguf")
    if job["how"] == "qconvert":
        _redirect(case_dir / "build.out", case_dir / "build.err")
        rc = _run_cli([f"{job['src_fmt']}->gguf", job["src"], str(tmp), "--quiet", "--force", *job["args"]])
    else:
        _redirect(case_dir / "build.out", case_dir / "build.err")
        f32 = Path(job["f32"])
        rc = 0
        if not f32.exists():
            rc = _run_cli(["hf->gguf", job["src"], str(f32), "--type", "f32", "--quiet", "--force"])
        if rc == 0:
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = job["ftype"]
            params.nthread = 1
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
    if rc == 0 and tmp.exists():
        tmp.replace(dst)
    return 0 if rc == 0 else 3


# ==============================================================================================================
# the parent: a fork server


@dataclass
class Running:
    job: dict
    start: float
    on_done: object
    killed: bool = False


class ForkPool:
    def __init__(self, jobs: int):
        self.jobs = max(1, jobs)
        self.running: dict[int, Running] = {}

    def submit(self, job: dict, target, on_done) -> None:
        while len(self.running) >= self.jobs:
            self._reap(block=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            rc = 99
            try:
                rc = target(job)
            except BaseException:
                try:
                    traceback.print_exc()
                finally:
                    rc = 98
            finally:
                os._exit(rc)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        self.running[pid] = Running(job, time.monotonic(), on_done)

    def _reap(self, block: bool) -> None:
        while True:
            done = False
            for pid, r in list(self.running.items()):
                wpid, status, rusage = os.wait4(pid, os.WNOHANG)
                if wpid:
                    del self.running[pid]
                    r.on_done(r.job, status, rusage, time.monotonic() - r.start, r.killed)
                    done = True
                elif not r.killed and time.monotonic() - r.start > r.job["timeout"] + r.job.get("grace", 30):
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    r.killed = True
            if done or not block or not self.running:
                return
            time.sleep(0.02)

    def drain(self) -> None:
        while self.running:
            self._reap(block=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


LIBRARY_TEXT = re.compile(
    r"Traceback|<class |\b[A-Z]\w*(?:Error|Exception|Warning)\b|deserializ|MetadataIncompleteBuffer|HeaderTooLarge|"
    r"InvalidHeader|InvalidOffset|out of bounds|unpack requires|invalid load key|PytorchStreamReader|"
    r"DefaultCPUAllocator|Weights only load failed|cannot reshape|index out of range|not enough values to unpack|"
    r"has no attribute|not subscriptable|unsupported operand|invalid literal for|codec can't decode|"
    r"object is not|positional argument|unexpected keyword|must be real number|division by zero|"
    r"math domain error|buffer size|WeightsUnpickler|GLOBAL |Unsupported global|expected str, bytes|"
    r"not supported between instances|object cannot be interpreted|can't multiply sequence")
ALLOC_TEXT = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory|Unable to allocate|"
                        r"memory allocation of \d+ bytes failed|std::bad_alloc|out of memory|OutOfMemory")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)', re.M)


def _rel_repo(path: str) -> str | None:
    try:
        p = Path(path).resolve()
        rel = p.relative_to(REPO)
    except (ValueError, OSError):
        return None
    if rel.parts[:1] in (("scripts",), ("tests",)) or ".venv" in rel.parts:
        return None
    return str(rel)


def tb_signature(text: str, most_recent_first: bool = False) -> tuple[str, str]:
    """(exception line, "ExcType at file:function" of the innermost qconvert frame)."""
    frames = [(m["file"], m["func"], m["line"]) for m in _FRAME.finditer(text)]
    if most_recent_first:
        frames = frames[::-1]
    ours = [(r, fn, ln) for f, fn, ln in frames if (r := _rel_repo(f))]
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    exc = next((ln for ln in reversed(lines) if not ln.startswith((" ", "\t")) and ":" in ln
                and not ln.startswith(("File", "Traceback", "Thread", "Current thread", "Fatal"))), lines[-1] if lines else "")
    etype = exc.split(":", 1)[0].strip() if exc else "?"
    where = f"{ours[-1][0]}:{ours[-1][1]}" if ours else (f"{Path(frames[-1][0]).name}:{frames[-1][1]}" if frames else "?")
    return exc.strip()[:300], f"{etype} at {where}"


def _normalize(msg: str, root: str) -> str:
    msg = msg.replace(root, "IN")
    msg = re.sub(r"\((?:[^()]|\([^()]*\))*\)", "(…)", msg)  # what a message quotes in parentheses: the example shows it
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:160]


@dataclass
class Outcome:
    outcome: str
    command: str = ""
    line: str = ""
    signature: str = ""


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def classify_command(name: str, rc: int | None, err: str, root: str, out: Path, case_dir: Path) -> Outcome:
    lines = [ln.rstrip("\r") for ln in err.split("\n") if ln.strip()]  # lines as a terminal shows them
    if ALLOC_TEXT.search(err):
        exc, sig = tb_signature(err)
        first = next((ln for ln in lines if ALLOC_TEXT.search(ln)), exc)
        return Outcome("alloc", name, first[:300], sig if "at ?" not in sig else _normalize(first, root))
    if rc == 0:
        if lines:
            return Outcome("noisy", name, lines[0][:300], "stderr on success: " + _normalize(lines[0], root))
        return Outcome("ok", name)
    if rc == 2:
        idx = next((i for i, ln in enumerate(lines) if ln.startswith("qconvert: error: ")), None)
        if idx is None:
            return Outcome("bad-refusal", name, (lines[-1] if lines else "")[:300],
                           "no `qconvert: error:` line: " + _normalize(lines[-1] if lines else "", root))
        line = lines[idx]
        msg = line[len("qconvert: error: "):]
        detail = msg.split(": ", 1)[1] if root in msg.split(": ", 1)[0] and ": " in msg else msg
        if idx > 0:
            return Outcome("warning-first", name, lines[0][:300], "before the error: " + _normalize(lines[0], root))
        if len(lines) > 1:
            return Outcome("bad-refusal", name, line[:300], "several lines: " + _normalize(detail, root))
        if _CONTROL.search(msg):
            return Outcome("bad-refusal", name, line[:300], "control characters in the message: " +
                           _normalize(_CONTROL.sub("?", detail), root)[:60])
        if LIBRARY_TEXT.search(msg):
            return Outcome("bad-refusal", name, line[:300], "library text: " + _normalize(detail, root))
        if root not in msg:
            return Outcome("bad-refusal", name, line[:300], "names no input file: " + _normalize(msg, root))
        if name in ("convert", "to-gguf"):
            target = out if name == "convert" else case_dir / "out.gguf"
            left = [p.name for p in case_dir.iterdir() if ".qconvert-tmp-" in p.name and target.name in p.name]
            if target.exists() or left:
                return Outcome("bad-refusal", name, line[:300],
                               f"left output behind ({target.name if target.exists() else left[0]})")
        return Outcome("refused", name, line[:300], _normalize(detail, root))
    exc, sig = tb_signature(err)
    debug = _read(case_dir / f"{name}.debug.err")
    if _FRAME.search(debug):  # the same command with --debug: the exception and its innermost qconvert frame
        _, sig = tb_signature(debug)
    if rc is None:
        return Outcome("traceback", name, exc or "crashed", sig)
    return Outcome("traceback", name, (lines[-1] if lines else exc or f"exit {rc}")[:300], sig if exc else f"exit {rc}")


def classify_case(case_dir: Path, status: int | None, rusage, killed: bool) -> tuple[Outcome, dict, dict]:
    meta = json.loads(_read(case_dir / "case.json") or "{}")
    res = json.loads(_read(case_dir / "result.json") or "{}")
    root = str(case_dir / "in")
    out = case_dir / "out"
    hang = _read(case_dir / "hang.txt")
    crash = _read(case_dir / "crash.txt")
    done = {c["name"]: c for c in res.get("commands", [])}
    names = [n for n in ("inspect", "convert", "to-gguf") if (case_dir / f"{n}.err").exists()]
    current = names[-1] if names else "setup"
    if meta.get("skip"):
        return Outcome("skipped", "", meta["skip"], "skipped"), meta, res
    if not meta:  # the fuzzer itself failed before the case ran (copying or mutating the seed)
        exc, sig = tb_signature(_read(case_dir / "setup.err"))
        return Outcome("error", "setup", exc or "no case.json", "fuzzer: " + sig), meta, res
    if hang.strip() or killed:
        _, sig = tb_signature(hang, most_recent_first=True) if hang.strip() else ("", "killed")
        return Outcome("hang", current, "over the time bound", "hang: " + sig.split(" at ", 1)[-1]), meta, res
    worst = Outcome("ok")
    for n in names:
        err = _read(case_dir / f"{n}.err")
        if n in done:
            o = classify_command(n, done[n]["rc"], err, root, out, case_dir)
        else:  # the child died in this command
            sig_no = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
            text = err + "\n" + crash
            if ALLOC_TEXT.search(text):
                o = classify_command(n, None, text, root, out, case_dir)
            else:
                exc, sig = tb_signature(crash or err, most_recent_first=bool(crash))
                what = f"killed by {signal.Signals(sig_no).name}" if sig_no else f"child exit {os.WEXITSTATUS(status) if status is not None else '?'}"
                o = Outcome("traceback", n, f"{what} {exc}".strip()[:300], f"{what} at {sig.split(' at ', 1)[-1]}")
        if SEVERITY[o.outcome] > SEVERITY[worst.outcome]:
            worst = o
    growth = res.get("rss_growth")
    if growth is None and rusage is not None:
        growth = None  # ru_maxrss includes the forked parent's pages; only the child's own reading counts
    bound = res.get("bound", 512 * MB)
    if growth is not None and growth > bound and SEVERITY[worst.outcome] < SEVERITY["alloc"]:
        worst = Outcome("alloc", current, f"RSS grew by {growth // MB} MB (bound {bound // MB} MB)",
                        f"rss growth {meta.get('kind')}")
    return worst, meta, res


def silent_outcome(worst: Outcome, meta: dict, diff: str | None) -> Outcome:
    if diff and SEVERITY[worst.outcome] < SEVERITY["silent"]:
        return Outcome("silent", "convert", diff[:300], f"silent {meta.get('kind')}: " +
                       "; ".join(re.sub(r"^\d+ ", "", part.split(" (")[0]) for part in diff.split("; ")))
    return worst


# ==============================================================================================================
# driver


def code_hash() -> str:
    h = hashlib.sha1()
    for sub in ("converters", "formats", "kernels"):
        for p in sorted((REPO / sub).rglob("*.py")):
            h.update(p.relative_to(REPO).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class Fuzzer:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.cases_dir = Path(tempfile.mkdtemp(prefix="cases-", dir=self.work))
        self.pool = ForkPool(args.jobs)
        self.counts: dict[str, dict[str, int]] = {}
        self.command_seconds: dict[str, dict[str, float]] = {}  # reader -> command (and "case", the whole child) -> seconds
        self.findings: list[dict] = []
        self.seed_failures: list[str] = []
        self.refs: dict[tuple[str, str], object] = {}  # digest, None (seed failed) or [pending cases]
        self.ref_queue: list[dict] = []
        self.seed_of: dict[tuple[str, str], Seed] = {}
        self.findings_fh = None
        self.hash = getattr(args, "code_hash", None) or code_hash()
        for old in (self.work / "refs").glob("*"):  # references of older code versions, unused for an hour
            if old.name != self.hash and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        self.only = args.mutations
        self.targets = [t.strip() for t in args.targets.split(",") if t.strip()]

    # -- seeds ---------------------------------------------------------------------------------------------
    def build_gguf_seeds(self) -> None:
        d = gguf_seed_dir(self.work)
        d.mkdir(parents=True, exist_ok=True)
        jobs = []
        for name, (fmt, src, extra) in gguf_builds().items():
            if not (d / f"{name}.gguf").exists() and _done(src.parent if fmt == "gptq" else src):
                jobs.append({"how": "qconvert", "src_fmt": fmt, "src": str(src), "args": extra,
                             "dst": str(d / f"{name}.gguf")})
        wide = FIXTURES / "uqff" / "wide"
        try:
            import importlib.util
            have_llama = importlib.util.find_spec("llama_cpp") is not None
        except Exception:
            have_llama = False
        if have_llama and _done(wide):
            todo = [(n, ft) for n, ft in LLAMA_BUILDS.items() if not (d / f"{n}.gguf").exists()]
            if todo:
                # the F32 file first (one job), then the quantizations
                jobs.append({"how": "llama", "src": str(wide), "f32": str(d / "wide-f32.gguf"), "ftype": todo[0][1],
                             "dst": str(d / f"{todo[0][0]}.gguf"), "first": True})
                for n, ft in todo[1:]:
                    jobs.append({"how": "llama", "src": str(wide), "f32": str(d / "wide-f32.gguf"), "ftype": ft,
                                 "dst": str(d / f"{n}.gguf")})
        for job in jobs:
            job.update(dir=str(Path(tempfile.mkdtemp(prefix="build-", dir=self.cases_dir))), timeout=600)

            def done(job, status, rusage, seconds, killed):
                if not Path(job["dst"]).exists():
                    self.seed_failures.append(f"gguf seed {Path(job['dst']).name}: "
                                              f"{_read(Path(job['dir']) / 'build.err').strip()[-500:] or 'failed'}")
            if job.get("first"):  # the F32 file is shared: build it before the others start
                self.pool.drain()
                self.pool.submit(job, child_build_gguf, done)
                self.pool.drain()
            else:
                self.pool.submit(job, child_build_gguf, done)
        self.pool.drain()

    def ref_path(self, reader: str, seed: Seed) -> Path:
        mtime = int(max((p.stat().st_mtime for p in ([seed.path] if seed.kind == "file" else seed.path.rglob("*"))
                         if p.is_file()), default=0))
        return self.work / "refs" / self.hash / f"{reader}--{_safe(seed.name)}--{mtime}.json"

    # -- the seeds' own conversions (the silent-corruption references), made when a case first needs one ----
    def need_ref(self, reader: str, seed: Seed, pending=None) -> None:
        """Compare a pending case with the seed's conversion once it exists (pending None: start making it)."""
        key = (reader, seed.name)
        if key in self.refs:
            if isinstance(self.refs[key], list):  # being made
                if pending is not None:
                    self.refs[key].append(pending)
            elif pending is not None:
                self.finish(*pending, ref=self.refs[key])
            return
        path = self.ref_path(reader, seed)
        if path.exists():
            self.refs[key] = json.loads(path.read_text())
            if pending is not None:
                self.finish(*pending, ref=self.refs[key])
            return
        self.refs[key] = [pending] if pending is not None else []
        path.parent.mkdir(parents=True, exist_ok=True)
        case_dir = Path(tempfile.mkdtemp(prefix="ref-", dir=self.cases_dir))
        job = {"dir": str(case_dir), "reader": reader, "seed_name": seed.name, "seed_path": str(seed.path),
               "seed_kind": seed.kind, "mutate": False, "ref_out": str(path), "timeout": self.args.timeout * 4,
               "inspect": True, "case": -1, "master_seed": self.args.seed, "targets": self.targets}
        self.ref_queue.append(job)

    def on_ref(self, job, status, rusage, seconds, killed) -> None:
        key = (job["reader"], job["seed_name"])
        o, _, _ = classify_case(Path(job["dir"]), status, rusage, killed)
        path = Path(job["ref_out"])
        waiting = self.refs[key]
        if not path.exists():
            self.refs[key] = None
            self.seed_failures.append(f"{job['reader']} seed {job['seed_name']}: its own conversion gave "
                                      f"{o.outcome}: {o.line}")
        else:
            self.refs[key] = json.loads(path.read_text())
        if path.exists() and o.outcome not in ("ok", "noisy"):
            self.seed_failures.append(f"{job['reader']} seed {job['seed_name']}: {o.outcome}: {o.line}")
        shutil.rmtree(job["dir"], ignore_errors=True)
        for pending in waiting:
            self.finish(*pending, ref=self.refs[key])

    def _submit_refs(self) -> None:
        while self.ref_queue:
            self.pool.submit(self.ref_queue.pop(0), child_case, self.on_ref)

    # -- cases ---------------------------------------------------------------------------------------------
    def case_job(self, reader: str, seed: Seed, case: int) -> dict:
        case_dir = self.cases_dir / f"{reader}-{case:05d}"
        if case_dir.exists():
            shutil.rmtree(case_dir)
        case_dir.mkdir(parents=True)
        return {"dir": str(case_dir), "reader": reader, "seed_name": seed.name, "seed_path": str(seed.path),
                "seed_kind": seed.kind, "case": case, "master_seed": self.args.seed, "timeout": self.args.timeout,
                "only": self.only, "inspect": True, "targets": self.targets}

    def on_case(self, job, status, rusage, seconds, killed) -> None:
        o, meta, res = classify_case(Path(job["dir"]), status, rusage, killed)
        pending = (job, o, meta, res, seconds)
        if res.get("digest") is not None and SEVERITY[o.outcome] < SEVERITY["silent"]:  # hf exited 0
            self.need_ref(job["reader"], self.seed_of[(job["reader"], job["seed_name"])], pending)
        else:
            self.finish(*pending, ref=None)

    def finish(self, job, o, meta, res, seconds, ref) -> None:
        case_dir = Path(job["dir"])
        reader = job["reader"]
        if ref is not None and res.get("digest") is not None:
            o = silent_outcome(o, meta, compare_digests(ref, res["digest"]))
        row = self.counts.setdefault(reader, {})
        row[o.outcome] = row.get(o.outcome, 0) + 1
        times = self.command_seconds.setdefault(reader, {"case": 0.0})
        times["case"] = round(times["case"] + seconds, 3)
        for c in res.get("commands", ()):
            times[c["name"]] = round(times.get(c["name"], 0.0) + c["seconds"], 3)
        o.line = o.line.replace(str(case_dir / "in"), "IN").replace(str(case_dir), "CASE")
        record = None
        if o.outcome in FINDING_OUTCOMES:
            record = {"reader": reader, "seed": job["seed_name"], "seed_path": job["seed_path"], "case": job["case"],
                      "master_seed": job["master_seed"], "kind": meta.get("kind"), "mutation": meta.get("mutation"),
                      "structural": meta.get("structural"), "outcome": o.outcome, "command": o.command,
                      "line": o.line, "signature": o.signature, "seconds": round(seconds, 2),
                      "rss_growth_mb": round((res.get("rss_growth") or 0) / MB, 1), "only": job.get("only")}
            if self.args.keep:
                keep = Path(self.args.keep) / f"{reader}-{job['case']:05d}"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(case_dir, keep, ignore=shutil.ignore_patterns("out", "out-debug", "tmp",
                                                                              ".*qconvert-tmp*"))
                (keep / "case.json").write_text(json.dumps(record, indent=1))
                record["kept"] = str(keep)
            self.findings.append(record)
            if self.findings_fh:
                self.findings_fh.write(json.dumps(record) + "\n")
                self.findings_fh.flush()
        if self.args.verbose or (record and not self.args.quiet):
            print(f"{reader:>8} #{job['case']:<5} {o.outcome:<13} {meta.get('mutation') or ''}"[:200]
                  + (f"\n{'':>16}{o.line[:180]!r}"[:200] if (record or self.args.verbose) and o.line else ""), flush=True)
        self.last = (o, meta, res)
        if not self.args.replay_mode:
            shutil.rmtree(case_dir, ignore_errors=True)

    def run(self, readers: list[str], n_cases: int) -> None:
        self.findings_fh = open(self.args.findings, "w") if self.args.findings else None
        t0 = time.monotonic()
        if "gguf" in readers:
            self.build_gguf_seeds()
        plan = []
        for reader in readers:
            seeds = seeds_for(reader, self.work)
            if self.args.max_seeds:
                seeds = seeds[: self.args.max_seeds]
            if not seeds:
                self.seed_failures.append(f"{reader}: no seeds (are the fixtures built?)")
                continue
            for case in range(n_cases):
                seed = seeds[random.Random(f"{self.args.seed}:{reader}:{case}").randrange(len(seeds))]
                plan.append((reader, seed, case))
                self.seed_of[(reader, seed.name)] = seed
        # every seed used is converted once as it is: the reference for silent corruption, and a check that the
        # seed itself is fine (a seed that fails is reported); these run first, alongside the first cases
        for (reader, _), seed in sorted(self.seed_of.items(), key=lambda kv: kv[0]):
            self.need_ref(reader, seed)
        # interleave the readers so that a slow one does not come last
        plan.sort(key=lambda x: (x[2], readers.index(x[0])))
        for reader, seed, case in plan:
            self._submit_refs()
            self.pool.submit(self.case_job(reader, seed, case), child_case, self.on_case)
        while self.pool.running or self.ref_queue:
            self._submit_refs()
            self.pool.drain()
        self.seconds = time.monotonic() - t0
        if self.findings_fh:
            self.findings_fh.close()
        shutil.rmtree(self.cases_dir, ignore_errors=True)

    def table(self) -> str:
        cols = list(OUTCOMES[1:]) + ["skipped"]
        head = f"{'reader':<8} " + " ".join(f"{c:>9}" for c in cols) + f" {'total':>6}"
        rows = [head]
        total = {c: 0 for c in cols}
        for reader in sorted(self.counts):
            row = self.counts[reader]
            rows.append(f"{reader:<8} " + " ".join(f"{row.get(c, 0):>9}" for c in cols) + f" {sum(row.values()):>6}")
            for c in cols:
                total[c] += row.get(c, 0)
        rows.append(f"{'all':<8} " + " ".join(f"{total[c]:>9}" for c in cols) + f" {sum(total.values()):>6}")
        return "\n".join(rows)


def write_markdown(path: Path, fz: Fuzzer, argv: list[str]) -> None:
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in fz.findings:
        groups.setdefault((r["reader"], r["outcome"], r["signature"]), []).append(r)
    lines = ["# qconvert fuzz findings", "",
             f"Run: `python scripts/fuzz.py {' '.join(argv)}` at {time.strftime('%Y-%m-%d %H:%M')} "
             f"(code {fz.hash}, git {_git_head()}), {sum(sum(r.values()) for r in fz.counts.values())} cases "
             f"in {fz.seconds:.0f} s.", "", "```", fz.table(), "```", ""]
    if fz.seed_failures:
        lines += ["Seed problems:", ""] + [f"- {s}" for s in fz.seed_failures] + [""]
    for reader in sorted({k[0] for k in groups}):
        lines += [f"## {reader}", ""]
        for outcome in OUTCOMES[::-1]:
            sigs = sorted((k for k in groups if k[0] == reader and k[1] == outcome), key=lambda k: -len(groups[k]))
            if not sigs:
                continue
            lines += [f"### {outcome}", ""]
            for k in sigs:
                ex = min(groups[k], key=lambda r: r["case"])
                case = {x: ex[x] for x in ("reader", "seed", "case", "master_seed")}
                if ex.get("only"):
                    case["only"] = ex["only"]
                lines += [f"- **{k[2]}** ({len(groups[k])} case(s)); e.g. case {ex['case']}, seed `{ex['seed']}`: "
                          f"{ex['mutation']}", f"  - {ex['command']}: `{ex['line'][:240]}`",
                          f"  - reproduce: `python scripts/fuzz.py --replay '{json.dumps(case)}'`"]
            lines.append("")
    Path(path).write_text("\n".join(lines) + "\n")


def _git_head() -> str:
    try:
        import subprocess
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except Exception:
        return "?"


def replay(args) -> int:
    text = args.replay
    if Path(text).exists():  # a kept case.json (indented) or a findings .jsonl (its first line)
        whole = Path(text).read_text().strip()
        try:
            json.loads(whole)
            text = whole
        except json.JSONDecodeError:
            text = whole.splitlines()[0]
    case = json.loads(text)
    reader = case["reader"]
    args.seed = case.get("master_seed", args.seed)
    args.mutations = case.get("only")
    args.replay_mode = True
    fz = Fuzzer(args)
    seeds = {s.name: s for s in seeds_for(reader, fz.work)}
    seed = seeds.get(case["seed"]) or (Seed(case["seed"], Path(case["seed_path"]),
                                             "file" if str(case.get("seed_path", "")).endswith(".gguf") else "dir")
                                        if case.get("seed_path") else None)
    if seed is None:
        print(f"seed {case['seed']!r} of reader {reader} not found; known: {sorted(seeds)}", file=sys.stderr)
        return 2
    fz.seed_of[(reader, seed.name)] = seed
    job = fz.case_job(reader, seed, int(case["case"]))
    fz.pool.submit(job, child_case, fz.on_case)
    while fz.pool.running or fz.ref_queue:
        fz._submit_refs()
        fz.pool.drain()
    o, meta, res = fz.last
    case_dir = Path(job["dir"])
    print(f"reader {reader}, seed {seed.name} ({seed.path}), case {case['case']}, master seed {args.seed}")
    print(f"mutation [{meta.get('kind')}]: {meta.get('mutation')} (structural: {meta.get('structural')})")
    for c in res.get("commands", []):
        print(f"\n$ qconvert {' '.join(c['argv'])}\n-> exit {c['rc']} in {c['seconds']} s")
        err = _read(case_dir / f"{c['name']}.err")
        if err.strip():
            print(err.rstrip()[-6000:])
    for extra in ("hang.txt", "crash.txt"):
        text = _read(case_dir / extra)
        if text.strip():
            print(f"\n{extra}:\n{text.rstrip()[-4000:]}")
    print(f"\noutcome: {o.outcome} {o.signature}\n{o.line}")
    print(f"case folder (mutated input in {case_dir / 'in'}): {case_dir}")
    return 0 if o.outcome in ("ok", "refused") else 1


def preload_qconvert() -> list[str]:
    """Import every module of qconvert here, once: the children inherit them (no torch op runs in this
    process) and never import qconvert code from disk, so a run tests one version of the code even while
    the working tree changes under it (a child importing a newer converters/run.py next to older modules
    would fail with ImportErrors that are not qconvert's). Returns the modules that could not be imported."""
    import importlib
    import pkgutil

    failed = []
    for sub in ("converters", "formats", "kernels"):
        pkg = importlib.import_module(f"qconvert.{sub}")
        for info in pkgutil.walk_packages(pkg.__path__, f"qconvert.{sub}."):
            if "triton" in info.name:  # GPU kernels: never used on CPU, and importing triton is slow
                continue
            try:
                importlib.import_module(info.name)
            except Exception:
                failed.append(info.name)
    from qconvert.converters.registry import all_formats

    all_formats()
    return failed


def main(argv=None) -> int:
    global FIXTURES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", default=",".join(READERS), help=f"comma-separated, of {', '.join(READERS)}")
    ap.add_argument("--cases", type=int, default=100, help="cases per reader")
    ap.add_argument("--seed", type=int, default=0, help="master seed")
    ap.add_argument("--jobs", type=int, default=2, help="parallel forked children")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case (over it: hang)")
    ap.add_argument("--findings", help="write every finding as a JSON line here")
    ap.add_argument("--report-md", help="write the findings grouped by reader, outcome and signature (markdown)")
    ap.add_argument("--summary-json", help="write the counts and seed problems as JSON")
    ap.add_argument("--keep", help="copy every failing case (mutated input, stderr) into this folder")
    ap.add_argument("--work", default=str(DEFAULT_WORK), help="cache of GGUF seeds and seed references")
    ap.add_argument("--targets", default="hf,gguf", help="conversions run per case after inspect: hf (--type f32, "
                    "always; compared with the seed's for silent corruption) and gguf (--type f16)")
    ap.add_argument("--fixtures", default=str(FIXTURES), help="the test fixtures folder the seeds come from")
    ap.add_argument("--max-seeds", type=int, default=0, help="use only the first K seeds of each reader")
    ap.add_argument("--mutations", help="only mutation kinds matching this regex (e.g. 'gguf|cfg')")
    ap.add_argument("--replay", help="rerun one case: a findings JSON line, a file holding one, or a case JSON")
    ap.add_argument("--verbose", action="store_true", help="print every case")
    ap.add_argument("--quiet", action="store_true", help="print only the table")
    args = ap.parse_args(argv)
    args.replay_mode = False
    FIXTURES = Path(args.fixtures).resolve()

    code = code_hash()  # of the code preloaded next
    preload_qconvert()

    args.code_hash = code
    if args.replay:
        return replay(args)
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    unknown = [r for r in readers if r not in READERS]
    if unknown:
        ap.error(f"unknown readers {unknown}; known: {', '.join(READERS)}")
    fz = Fuzzer(args)
    fz.run(readers, args.cases)
    print(fz.table())
    if fz.seed_failures:
        print("seed problems:\n  " + "\n  ".join(fz.seed_failures))
    by_sig = {}
    for r in fz.findings:
        by_sig.setdefault((r["reader"], r["outcome"], r["signature"]), 0)
        by_sig[(r["reader"], r["outcome"], r["signature"])] += 1
    if by_sig and not args.quiet:
        print("\nfindings by signature:")
        for (reader, outcome, sig), n in sorted(by_sig.items()):
            print(f"  {reader:>8} {outcome:<13} {n:>4}  {sig}"[:220])
    print(f"{sum(sum(r.values()) for r in fz.counts.values())} cases in {fz.seconds:.0f} s")
    if args.report_md:
        write_markdown(Path(args.report_md), fz, sys.argv[1:] if argv is None else list(argv))
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps({
            "counts": fz.counts, "seed_failures": fz.seed_failures, "seconds": round(fz.seconds, 1),
            "command_seconds": fz.command_seconds,
            "findings": [{k: r[k] for k in ("reader", "outcome", "signature", "case", "seed", "mutation", "line")}
                         for r in fz.findings]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
