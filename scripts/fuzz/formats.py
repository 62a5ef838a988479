"""safetensors, GGUF and zip (torch.save) structure in pure Python, with byte positions for raw edits: the
mutations edit files with these, and the child digests the converted safetensors with them (the parent
never runs torch).
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

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
