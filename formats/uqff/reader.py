"""UQFF reader: a mistral.rs model directory (`<stem>-N.uqff` shards + residual.safetensors + config and
tokenizer files) as tensor records.

Every shard is a safetensors file; all shards of a set share one namespace (a layer's sub-tensors may sit
in different shards). The version tensors `uqff.version.{major,minor,patch}` (U32 scalars, in some shard)
decide whether we can read it: major 1, minor up to READER_MINOR. Layers become records named
`<key>.weight`: GGUF blocks as `Grid`s carrying their bytes (`PackedCodes(layout="ggml:<TYPE>")`, so a GGUF
or UQFF writer of the same type copies blocks), HQQ as axis-0 grids, AFQ as min-form grids (or integer
zero points when the biases provably sit on the integer grid), FP8 / F8Q8 / MXFP4 / Unquant as `Dense`
float tensors decoded as mistral.rs decodes them. `<key>.bias` and the residual tensors are `Dense`.
Shards are opened lazily and one layer is read at a time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from ...converters.errors import BadInput
from ...converters.records import Dense, Grid, GridParams, PackedCodes, TensorRecord
from ...kernels.ggml_kblocks import K_ZERO_POINT, unpack_k_blocks
from ...kernels.ggml_layouts import LAYOUTS
from ...kernels.ggml_legacy import unpack_blocks
from ..safetensors_dir import SIDE_FILES, read_json
from .layout import (EXTRA_BLOCKS, FAMILY_OF_TAG, GGML_NAME_OF_ID, MAJOR, READER_MINOR, decode_f8q8, decode_mxfp4,
                     decode_q8_1, decode_q8_k, hqq_halves_unpack, unpack_afq)

__all__ = ["UqffSource", "open_uqff", "shard_set", "is_uqff_file"]

_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d+)\.uqff$")
_VERSION_KEYS = ("uqff.version.major", "uqff.version.minor", "uqff.version.patch")
_TORCH_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def is_uqff_file(path: Path) -> bool:
    """A safetensors file whose header names the UQFF version tensors or a `.weight.format` layer tag."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 100_000_000:
                return False
            head = f.read(n)
    except OSError:
        return False
    return b'"uqff.version.major"' in head or b'.weight.format"' in head


def shard_set(path: Path) -> list[Path]:
    """The shards to read: a `.uqff` file expands to its contiguous set `<stem>-0.uqff, <stem>-1.uqff, ...`
    (as mistral.rs does); a directory must hold exactly one such set."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.uqff"))
        if not files:
            raise BadInput("no .uqff file in this directory", path=path)
        stems = sorted({(_SHARD_RE.match(p.name) or {"stem": p.stem})["stem"] for p in files})
        if len(stems) > 1:
            raise BadInput(f"several UQFF sets here ({', '.join(stems)}); name one, e.g. "
                           f"{path / (stems[0] + '-0.uqff')}", path=path)
        first = next((p for p in files if p.name == f"{stems[0]}-0.uqff"), files[0])
        return shard_set(first)
    if not path.is_file():
        raise BadInput("no such file", path=path)
    m = _SHARD_RE.match(path.name)
    if not m:
        return [path]
    shards, i = [], 0
    while (path.parent / f"{m['stem']}-{i}.uqff").exists():
        shards.append(path.parent / f"{m['stem']}-{i}.uqff")
        i += 1
    if path not in shards:
        raise BadInput(f"shard set {m['stem']}-0.uqff .. is not contiguous up to this file", path=path)
    return shards


class _Shards:
    """The merged namespace of a shard set: tensor name -> shard, with lazy single-tensor reads."""

    def __init__(self, shards: list[Path]):
        self.shards = shards
        self.location: dict[str, Path] = {}
        self.order: list[str] = []
        for shard in shards:
            for name in self._open(shard, lambda f: list(f.keys())):
                if name in self.location and not name.startswith("uqff.version."):
                    raise BadInput(f"duplicate tensor key (also in {self.location[name].name})", path=shard,
                                   tensor=name)
                if name not in self.location:
                    self.order.append(name)
                self.location.setdefault(name, shard)

    def _open(self, shard: Path, fn):
        try:
            with safe_open(str(shard), framework="pt") as f:
                return fn(f)
        except BadInput:
            raise
        except Exception as e:  # truncated file, corrupt header, offsets past the end
            raise BadInput(f"cannot read safetensors file ({_one_line(e)})", path=shard) from None

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        shard = self.location.get(name)
        if shard is None:
            raise BadInput("tensor not found in any shard", path=self.shards[0], tensor=name)
        try:
            with safe_open(str(shard), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise BadInput(f"cannot read tensor ({_one_line(e)})", path=shard, tensor=name) from None

    def meta(self, name: str) -> tuple[str, list[int]]:
        def fn(f):
            s = f.get_slice(name)
            return s.get_dtype(), list(s.get_shape())
        return self._open(self.location[name], fn)

    def version_values(self) -> tuple[int, int, int] | None:
        """The version tensors; every shard that carries them must agree (mistral.rs' rule)."""
        found = None
        for shard in self.shards:
            def fn(f):
                keys = set(f.keys())
                if not any(k in keys for k in _VERSION_KEYS):
                    return None
                vals = []
                for k in _VERSION_KEYS:
                    if k not in keys:
                        raise BadInput("incomplete UQFF version tensors", path=shard, tensor=k)
                    s = f.get_slice(k)
                    if s.get_dtype() != "U32" or list(s.get_shape()) != []:
                        raise BadInput("UQFF version tensor must be a scalar U32", path=shard, tensor=k)
                    vals.append(int(f.get_tensor(k).to(torch.int64)))
                return tuple(vals)
            vals = self._open(shard, fn)
            if vals is not None:
                if found is not None and vals != found:
                    raise BadInput(f"conflicting UQFF version tensors ({'.'.join(map(str, vals))} vs "
                                   f"{'.'.join(map(str, found))})", path=shard)
                found = vals
        return found


def _scalar(t: torch.Tensor) -> int:
    return int(t.reshape(-1)[0].to(torch.int64)) if t.numel() == 1 else int(t.to(torch.int64))


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return _TORCH_NAME.get(dtype, str(dtype).replace("torch.", ""))


class UqffSource:
    """A UQFF model directory (or one `.uqff` file of it), read lazily layer by layer."""

    format_name = "uqff"

    def __init__(self, path: Path):
        path = Path(path)
        self.shard_paths = shard_set(path)
        self.path = self.shard_paths[0].parent
        self.shards = _Shards(self.shard_paths)
        self._check_version()
        cfg_path = self.path / "config.json"
        cfg = read_json(cfg_path) if cfg_path.exists() else {}
        self.config = _without_quantization_config(cfg)
        self.quant_config = {"quant_method": "uqff", "version": ".".join(map(str, self.version)),
                             "shards": [p.name for p in self.shard_paths]}
        self.layers: dict[str, dict[str, str]] = {}  # key -> {suffix: tensor name}
        self.biases: dict[str, str] = {}
        for name in self.shards.order:
            if name.startswith("uqff.version."):
                continue
            if ".weight" in name:
                key, _, rest = name.partition(".weight")
                self.layers.setdefault(key, {})["weight" + rest] = name
            elif name.endswith(".bias"):
                self.biases[name[: -len(".bias")]] = name
            else:
                raise BadInput("not a UQFF layer tensor (expected <key>.weight*, <key>.bias)",
                               path=self.shards.location[name], tensor=name)
        for key, parts in self.layers.items():
            if "weight.format" not in parts:
                where = self.shards.location[next(iter(parts.values()))]
                raise BadInput("layer has no .weight.format tag", path=where, tensor=f"{key}.weight.format")
            if "weight" not in parts:
                raise BadInput("layer has metadata but no weight", path=self.shards.location[parts["weight.format"]],
                               tensor=f"{key}.weight")
        self.residual = self._residual()

    # -- container checks -------------------------------------------------------------------------------
    def _check_version(self) -> None:
        first = self.shard_paths[0]
        names = [n for n in self.shards.order]
        if names and all(n.isdigit() for n in names):
            raise BadInput("pre-1.0 UQFF (numeric tensor names) is no longer supported by mistral.rs; regenerate "
                           "it with mistral.rs >= 0.8.4", path=first)
        version = self.shards.version_values()
        if version is None:
            raise BadInput("UQFF artifact has no version tensors uqff.version.major/minor/patch (a pre-1.0 or "
                           "non-UQFF file)", path=first)
        major, minor, _ = version
        if major != MAJOR:
            raise BadInput(f"UQFF major version {major} is not supported (this reader reads {MAJOR}.x)", path=first)
        if minor > READER_MINOR:
            raise BadInput(f"written by a newer mistral.rs: UQFF {major}.{minor}; this reader knows UQFF up to "
                           f"{MAJOR}.{READER_MINOR}", path=first)
        self.version = version

    def _residual(self):
        """residual.safetensors, else the model's own safetensors (what mistral.rs falls back to)."""
        from ..safetensors_dir import CheckpointDir

        candidates = [p for p in self.path.glob("*.safetensors")]
        if not candidates:
            return None
        if (self.path / "residual.safetensors").exists():
            return _Shards([self.path / "residual.safetensors"])
        return CheckpointDir(self.path)

    # -- one layer --------------------------------------------------------------------------------------
    def _part(self, key: str, suffix: str) -> torch.Tensor:
        parts = self.layers[key]
        if suffix not in parts:
            raise BadInput(f"missing {suffix} for this layer", path=self.shards.location[parts["weight"]],
                           tensor=f"{key}.{suffix}")
        return self.shards.get(parts[suffix])

    def family(self, key: str) -> str:
        tag = _scalar(self._part(key, "weight.format"))
        if tag not in FAMILY_OF_TAG:
            raise BadInput(f"unknown UQFF format tag {tag}", path=self.shards.location[self.layers[key]["weight"]],
                           tensor=f"{key}.weight.format")
        return FAMILY_OF_TAG[tag]

    def _bad(self, key: str, msg: str, suffix: str = "weight") -> BadInput:
        return BadInput(msg, path=self.shards.location[self.layers[key]["weight"]], tensor=f"{key}.{suffix}")

    def _shape(self, key: str) -> tuple[int, ...]:
        shape = tuple(int(x) for x in self._part(key, "weight.shape").to(torch.int64).tolist())
        if len(shape) != 2:
            raise self._bad(key, f"weight shape {list(shape)}: only 2-D layers are supported (stacked experts "
                                 "are not)", "weight.shape")
        return shape

    def describe_layer(self, key: str) -> tuple[tuple[int, ...], GridParams | None, str, dict]:
        """(shape, grid params or None, dtype label, notes) from the small tensors only."""
        fam = self.family(key)
        if fam == "gguf":
            shape = self._shape(key)
            type_id = _scalar(self._part(key, "weight.dtype"))
            name = GGML_NAME_OF_ID.get(type_id)
            if name is None:
                raise self._bad(key, f"unknown ggml type id {type_id}", "weight.dtype")
            notes = {"uqff_family": fam, "ggml_type": name}
            if name in LAYOUTS and LAYOUTS[name].kind != "float":
                return shape, self._load_gguf(key, shape, name).params, "grid", notes
            return shape, None, "float32" if name not in LAYOUTS else {"F32": "float32", "F16": "float16",
                                                                       "BF16": "bfloat16"}[name], notes
        notes = {"uqff_family": fam}
        if fam in ("hqq", "afq"):
            params, shape = self._load_hqq(key, False) if fam == "hqq" else self._load_afq(key, False)
            return shape, params, "grid", notes
        dtype, wshape = self.shards.meta(self.layers[key]["weight"])
        if fam == "unquant":
            return tuple(wshape), None, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype), notes
        if fam == "f8q8":
            return self._shape(key), None, "float32", notes
        if fam == "mxfp4":
            return (wshape[0], wshape[1] * 2), None, "float32", notes
        return tuple(wshape), None, "float32", notes  # fp8

    def load_layer(self, key: str) -> Dense | Grid:
        fam = self.family(key)
        if fam == "gguf":
            shape = self._shape(key)
            name = GGML_NAME_OF_ID.get(_scalar(self._part(key, "weight.dtype")))
            if name in LAYOUTS and LAYOUTS[name].kind != "float":
                return self._load_gguf(key, shape, name)
            return Dense(self._gguf_plain(key, shape, name))
        if fam in ("hqq", "afq"):
            return self._load_grid(key, fam)
        w = self._part(key, "weight")
        if fam == "unquant":
            return Dense(w)
        if fam == "fp8":
            if w.dtype != torch.float8_e4m3fn:
                raise self._bad(key, f"FP8 weight dtype {w.dtype} is not F8_E4M3")
            scale = self._part(key, "weight.dequant_w_scale").to(torch.float32)
            return Dense(w.to(torch.float32) * scale)
        if fam == "f8q8":
            shape = self._shape(key)
            nblocks = _scalar(self._part(key, "weight.num_blocks"))
            if w.dtype != torch.uint8 or w.numel() != nblocks * 33 or nblocks * 32 < shape[0] * shape[1]:
                raise self._bad(key, f"F8Q8 weight of {w.numel()} bytes does not hold {nblocks} blocks of 33 "
                                     f"for shape {list(shape)}")
            return Dense(decode_f8q8(w, shape[0] * shape[1]).view(shape))
        if fam == "mxfp4":
            scales = self._part(key, "weight.scales")
            if w.dtype != torch.uint8 or scales.dtype != torch.uint8 or w.dim() != 2 or \
                    tuple(scales.shape) != (w.shape[0], w.shape[1] * 2 // 32):
                raise self._bad(key, f"MXFP4 weight {list(w.shape)} / scales {list(scales.shape)} do not match")
            return Dense(decode_mxfp4(w, scales))
        raise self._bad(key, f"family {fam} not readable")

    def _gguf_bytes(self, key: str, shape, block: int, nbytes: int) -> torch.Tensor:
        rows, n = shape
        if n % block:
            raise self._bad(key, f"rows of {n} are not whole blocks of {block}")
        w = self._part(key, "weight")
        want = rows * (n // block) * nbytes
        if w.dtype != torch.uint8 or w.numel() != want:
            raise self._bad(key, f"{w.numel()} bytes of {w.dtype}, expected {want} uint8 for shape {list(shape)}")
        return w.reshape(rows, -1).contiguous()

    def _gguf_plain(self, key: str, shape, name: str) -> torch.Tensor:
        if name in EXTRA_BLOCKS:
            block, nbytes = EXTRA_BLOCKS[name]
            data = self._gguf_bytes(key, shape, block, nbytes)
            return decode_q8_1(data, shape[0]) if name == "Q8_1" else decode_q8_k(data, shape[0])
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        data = self._gguf_bytes(key, shape, 1, torch.tensor([], dtype=dtype).element_size())
        return data.view(dtype).view(shape)

    def _load_gguf(self, key: str, shape, name: str) -> Grid:
        lay = LAYOUTS[name]
        words = self._gguf_bytes(key, shape, lay.block, lay.nbytes)
        if lay.kind == "k":
            codes, scales, mins = unpack_k_blocks(name, words.numpy())
            codes, scales = torch.from_numpy(codes), torch.from_numpy(scales)
            if mins is None:
                zeros = torch.full_like(scales, K_ZERO_POINT[name], dtype=torch.int16)
            else:
                mins, zeros = torch.from_numpy(mins), torch.zeros_like(scales)
            group = lay.sub_block
        else:
            q, d, m = unpack_blocks(lay, words)
            scales, mins = d.to(torch.float16), None  # the stored fp16 block scale, exactly
            if lay.name == "Q8_0":
                codes, zeros = (q + 128).to(torch.uint8), torch.full_like(scales, 128, dtype=torch.int16)
            elif lay.has_min:
                codes, mins, zeros = q.to(torch.uint8), m, torch.zeros_like(m)
            else:
                codes, zeros = q.to(torch.uint8), torch.full_like(scales, lay.offset, dtype=torch.int16)
            group = lay.block
        params = GridParams(bits=lay.bits, group_size=group, scales=scales, zeros=zeros, mins=mins)
        return Grid(params, codes, PackedCodes(words, lay.bits, f"ggml:{name}"))

    def _load_grid(self, key: str, fam: str) -> Grid:
        return self._load_hqq(key) if fam == "hqq" else self._load_afq(key)

    def _load_hqq(self, key: str, with_codes: bool = True):
        out, n = self._shape(key)
        bits = _scalar(self._part(key, "weight.bits"))
        gs = _scalar(self._part(key, "weight.group_size"))
        axis = _scalar(self._part(key, "weight.axis"))
        if axis != 0:
            raise self._bad(key, f"HQQ axis {axis}: mistral.rs reads axis 0 only", "weight.axis")
        if bits not in (4, 8):
            raise self._bad(key, f"HQQ {bits}-bit layers are not supported (mistral.rs writes 4 and 8)", "weight.bits")
        if gs <= 0 or out % gs:
            raise self._bad(key, f"HQQ group size {gs} does not divide the {out} output rows", "weight.group_size")
        scales, zeros, w = self._part(key, "weight.scales"), self._part(key, "weight.zeros"), self._part(key, "weight")
        m = out * n // gs
        if scales.dtype != zeros.dtype or not scales.is_floating_point() or scales.numel() != m or zeros.numel() != m:
            raise self._bad(key, f"HQQ scales {list(scales.shape)} {scales.dtype} / zeros {list(zeros.shape)} "
                                 f"{zeros.dtype} do not match {m} groups", "weight.scales")
        if w.dtype != torch.uint8 or tuple(w.shape) != (gs * bits // 8, m):
            raise self._bad(key, f"HQQ weight {list(w.shape)} {w.dtype}, expected uint8 {[gs * bits // 8, m]}")
        # HQQ's [1, numel/gs] meta flattened row-major is the [R, in] matrix of records.py's axis-0 form
        r = out // gs
        params = GridParams(bits=bits, group_size=gs, scales=scales.reshape(r, n), zeros=zeros.reshape(r, n),
                            axis=0, compute_dtype=scales.dtype)
        if not with_codes:
            return params, (out, n)
        grouped = hqq_halves_unpack(w, bits)  # [gs, numel/gs]
        return Grid(params, grouped.reshape(out, n))

    def _load_afq(self, key: str, with_codes: bool = True):
        bits = _scalar(self._part(key, "weight.bits"))
        gs = _scalar(self._part(key, "weight.group_size"))
        w, scales, biases = self._part(key, "weight"), self._part(key, "weight.scales"), self._part(key, "weight.biases")
        if bits not in (2, 3, 4, 6, 8) or gs not in (32, 64, 128):
            raise self._bad(key, f"AFQ bits {bits} / group size {gs} not supported", "weight.bits")
        if w.dim() != 2 or w.dtype not in (torch.uint32, torch.int32):
            raise self._bad(key, f"AFQ weight must be a 2-D U32 tensor, got {list(w.shape)} {w.dtype}")
        out, n = w.shape[0], w.shape[1] * 32 // bits
        if scales.dtype != biases.dtype or tuple(scales.shape) != (out, n // gs) or tuple(biases.shape) != (out, n // gs):
            raise self._bad(key, f"AFQ scales {list(scales.shape)} / biases {list(biases.shape)} do not match "
                                 f"{out} x {n // gs} groups", "weight.scales")
        compute = scales.dtype
        zeros = _integer_zeros(scales, biases, bits)
        if zeros is not None:
            params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=zeros, compute_dtype=compute)
        else:
            params = GridParams(bits=bits, group_size=gs, scales=scales, zeros=torch.zeros_like(scales), mins=biases,
                                compute_dtype=compute)
        if not with_codes:
            return params, (out, n)
        codes = unpack_afq(w, bits, n)
        packed = PackedCodes(w.view(torch.int32).T.contiguous(), bits, "gptq-rows") if bits in (2, 3, 4, 8) else None
        return Grid(params, codes, packed)

    # -- the ModelSource interface ------------------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        for key in self.layers:
            shape, params, dtype, notes = self.describe_layer(key)
            where = str(self.shards.location[self.layers[key]["weight"]].name)
            yield TensorRecord(f"{key}.weight", shape, dtype, lambda k=key: self.load_layer(k), params=params,
                               source_file=where, notes=notes)
            if key in self.biases:
                yield self._dense_record(self.shards, self.biases[key])
        for key, name in self.biases.items():
            if key not in self.layers:
                yield self._dense_record(self.shards, name)
        if self.residual is not None:
            names = self.residual.order if isinstance(self.residual, _Shards) else list(self.residual.location)
            for name in names:
                if name.startswith("uqff.version.") or name[: -len(".weight")] in self.layers and name.endswith(".weight"):
                    continue  # UQFF layers override the dense copy (mistral.rs asks the UQFF first)
                yield self._dense_record(self.residual, name)

    def _dense_record(self, store, name: str) -> TensorRecord:
        if isinstance(store, _Shards):
            dtype, shape = store.meta(name)
            where = store.location[name].name
        else:
            dtype, shape, where = store.dtype(name), store.shape(name), store.location[name]
        from ..safetensors_dir import dtype_name as _dtype_name

        return TensorRecord(name, tuple(shape), _dtype_name(dtype), lambda: Dense(store.get(name)), source_file=where)

    def side_files(self) -> dict[str, Path]:
        return {n: self.path / n for n in SIDE_FILES if (self.path / n).exists()}

    @property
    def ignored_files(self) -> dict[str, str]:
        """Weight files in the folder that are neither its .uqff shards nor the residual tensors read."""
        from ..safetensors_dir import weight_files_ignored

        used = {p.name for p in self.shard_paths}
        used |= {Path(p).name for p in getattr(self.residual, "shards", None) or ["residual.safetensors"]}
        return weight_files_ignored(self.path, used, "not read (the residual tensors are elsewhere)")

    def describe(self) -> dict:
        families: dict[str, int] = {}
        for key in self.layers:
            fam = self.family(key)
            if fam == "gguf":
                fam = "gguf:" + GGML_NAME_OF_ID.get(_scalar(self._part(key, "weight.dtype")), "?")
            families[fam] = families.get(fam, 0) + 1
        return {"format": "uqff", "version": ".".join(map(str, self.version)),
                "shards": [p.name for p in self.shard_paths], "layers": len(self.layers), "families": families,
                "residual": None if self.residual is None else "residual.safetensors"
                if (self.path / "residual.safetensors").exists() else "model safetensors",
                "architectures": self.config.get("architectures"), "ignored_files": self.ignored_files}


def _integer_zeros(scales: torch.Tensor, biases: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Integer zero points z with bias = -scale*z, when the zero-point form (q - z) * s gives mistral.rs'
    s*q + b bit for bit: float32 arithmetic, fp16-representable scales (so every s*q and s*z is exact)
    and z an integer code. None otherwise: the grid then stays in the min form."""
    if scales.dtype != torch.float32:
        return None
    s = scales
    if not torch.equal(s.to(torch.float16).to(torch.float32), s) or bool((s == 0).any()):
        return None
    z = torch.round(-biases / s)
    if bool(((z < 0) | (z > (1 << bits) - 1)).any()):
        return None
    if not torch.equal(-(s * z), biases) and not torch.equal((-s) * z, biases):
        return None
    return z.to(torch.int16)


def _without_quantization_config(obj):
    """mistral.rs drops every `quantization_config` key, recursively; so do we."""
    if isinstance(obj, dict):
        return {k: _without_quantization_config(v) for k, v in obj.items() if k != "quantization_config"}
    if isinstance(obj, list):
        return [_without_quantization_config(v) for v in obj]
    return obj


def open_uqff(path: Path, **_: object) -> UqffSource:
    return UqffSource(path)
