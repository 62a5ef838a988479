"""GPTQ checkpoints (gptqmodel / AutoGPTQ / transformers): v1 (`gptq`) and v2 (`gptq_v2`).

Per quantized linear `<prefix>`: `qweight` int32 [in*b/32, out] (codes packed along rows),
`qzeros` int32 [G, out*b/32] (packed along columns), `scales` fp16 [G, out], `g_idx` int32 [in],
optional `bias`. W = scales[g_idx] * (q - z). v2 stores the true zero point z; v1 stores z - 1.

v1 decode: 2/4/8-bit words get the constant 0x55555555 / 0x11111111 / 0x01010101 added as whole
int32 words (wrapping), because gptqmodel's writer subtracted it as whole words and a zero point of 0
borrowed from its neighbour field; adding per field would decode the neighbour one too low. 3-bit zeros
are converted field by field (gptqmodel does the same). See shared spec gptq_qqq.md section 1.3.

Rotation (`"rotation": "hadamard" | "random"`, shared spec section 4): gptqmodel folds an exact Hadamard
into every `mlp.down_proj` and re-applies it to the activation at run time (everything else a rotation
does is already plain weights). Reading folds it into the weight, W_plain = W_q M^T (kernels/hadamard.py),
and yields that float tensor; runners mark it `requantize` (the target does not hold the rotated grid),
except for GPTQ output, which stores the rotated grid itself and keeps the `rotation` key (exact).

The v1/v2 label of the config is checked against the data: a symmetric tensor whose zero fields all
read 2**(b-1) - 1 is v1 data, all 2**(b-1) is v2 data. A label contradicted by the data is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .. import __version__
from ..converters.align import EXACT, REFUSED, REQUANTIZE, Verdict, check_grid_to_float, describe_grid
from ..converters.errors import BadInput, QConvertError
from ..converters.plan import Options, TensorPlan
from ..converters.records import Dense, Grid, GridParams, PackedCodes, TensorRecord
from ..converters.registry import FormatEntry, register_format
from ..kernels.bitpack import SUPPORTED_PACK_BITS, pack_rows, unpack_rows
from ..kernels.hadamard import UnsupportedHadamard, fold_online_hadamard, require_foldable
from ..kernels.rtn import quantize_rtn
from .safetensors_dir import CheckpointDir, ShardWriter, copy_side_files, quantization_config_of, read_json, write_json

__all__ = ["GptqSource", "GptqWriter", "open_gptq", "V1_WORD_OFFSET"]

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
# whole-word constant that turns v2 zero fields into v1 fields (one per field, 2/4/8-bit packing)
V1_WORD_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}
_DENSE_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
_EMBEDDING = re.compile(r"(^|\.)embed_tokens\.weight$")
_IN_FROM_HIDDEN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)$")
_IN_FROM_INTERMEDIATE = re.compile(r"\.down_proj$")


@dataclass(frozen=True)
class ModuleScheme:
    bits: int
    group_size: int  # -1 = one group per row
    sym: bool
    desc_act: bool


def _quant_config(path: Path, config: dict) -> dict:
    qc = config.get("quantization_config")
    qfile = path / "quantize_config.json"
    if not qc and qfile.exists():
        qc = read_json(qfile)
    if not qc:
        raise BadInput("no quantization_config in config.json and no quantize_config.json", path=path / "config.json")
    method = str(qc.get("quant_method", qc.get("method", "gptq"))).lower()
    if method != "gptq":
        raise BadInput(f"quant_method is {method!r}, not gptq", path=path / "config.json")
    return qc


def _zero_convention(qc: dict) -> str:
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise BadInput(f"checkpoint_format {fmt!r} is not gptq or gptq_v2 (planar/marlin/bitblas layouts are not GPTQ v1/v2)")
    return "v2" if fmt == "gptq_v2" else "v1"


def _module_scheme(qc: dict, module: str) -> ModuleScheme | None:
    """Resolve bits/group/sym/desc_act for one module: `dynamic` overrides (first match wins) over defaults.
    None means the module is excluded from quantization (a `-:` rule)."""
    base = {k: qc.get(k) for k in ("bits", "group_size", "sym", "desc_act")}
    for pattern, override in (qc.get("dynamic") or {}).items():
        negative = pattern.startswith("-:")
        regex = pattern[2:] if pattern[:2] in ("-:", "+:") else pattern
        if re.match(regex, module):
            if negative:
                return None
            base.update({k: v for k, v in (override or {}).items() if k in base})
            break
    try:
        return ModuleScheme(int(base["bits"]), int(base["group_size"] if base["group_size"] is not None else -1),
                            bool(base["sym"] if base["sym"] is not None else True), bool(base["desc_act"]))
    except (TypeError, ValueError):
        raise BadInput(f"quantization config has no usable bits/group_size for module {module}") from None


def decode_zeros(qzeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """[G, out*b/32] int32 -> [G, out] true zero points (int16)."""
    words = qzeros
    if convention == "v1" and bits in V1_WORD_OFFSET:
        w = (qzeros.to(torch.int64) & 0xFFFFFFFF) + V1_WORD_OFFSET[bits]
        words = (w & 0xFFFFFFFF).to(torch.int64)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    z = unpack_rows(words.T.contiguous(), bits).T.to(torch.int16)
    if convention == "v1" and bits not in V1_WORD_OFFSET:  # 3-bit: field by field
        z = (z + 1) % (1 << bits)
    return z.contiguous()


def encode_zeros(zeros: torch.Tensor, bits: int, convention: str) -> torch.Tensor:
    """[G, out] true zero points -> [G, out*b/32] int32 in the given convention."""
    z = zeros.to(torch.int64)
    if convention == "v1" and bits not in V1_WORD_OFFSET:
        z = (z - 1) % (1 << bits)
    words = pack_rows(z.T.contiguous(), bits).T.contiguous()
    if convention == "v1" and bits in V1_WORD_OFFSET:
        w = ((words.to(torch.int64) & 0xFFFFFFFF) - V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
        words = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return words


class GptqSource:
    """A GPTQ checkpoint directory, read lazily tensor by tensor."""

    def __init__(self, path: Path, expect: str | None = None):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        cfg = read_json(self.path / "config.json")
        self.quant_config = _quant_config(self.path, cfg)
        self.config = {k: v for k, v in cfg.items() if k != "quantization_config"}
        self.convention = _zero_convention(self.quant_config)
        self.format_name = "gptq-v2" if self.convention == "v2" else "gptq"
        self.rotation = _rotation_mode(self.quant_config, self.config, self.path / "config.json")
        # group tensor names by quantized module prefix
        self.modules = self.ckpt.group_modules(_PARTS, primary="qweight")

    # -- reading one module ---------------------------------------------------------------------
    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int], str]:
        parts = self.modules[prefix]
        qweight_name = parts["qweight"]
        where = self.ckpt.file_of(qweight_name)
        for needed in ("qzeros", "scales"):
            if needed not in parts:
                raise BadInput(f"qweight without {needed}", path=where, tensor=f"{prefix}.{needed}")
        scheme = _module_scheme(self.quant_config, prefix)
        if scheme is None:
            raise BadInput("module is quantized in the file but excluded by a dynamic '-:' rule", path=where, tensor=qweight_name)
        bits = scheme.bits
        if bits not in SUPPORTED_PACK_BITS:
            raise BadInput(f"unsupported bits {bits}: GPTQ v1/v2 packs {', '.join(map(str, SUPPORTED_PACK_BITS))}"
                           " (5-7 bit files use the planar gptq_p layout)", path=where, tensor=qweight_name)
        qshape = self.ckpt.shape(qweight_name)
        scales = self.ckpt.get(parts["scales"])
        qzeros = self.ckpt.get(parts["qzeros"])
        if len(qshape) != 2 or scales.dim() != 2 or qzeros.dim() != 2:
            raise BadInput("qweight, qzeros and scales must be 2-D", path=where, tensor=prefix)
        out_features = qshape[1]
        in_features = qshape[0] * 32 // bits
        if qshape[0] * 32 % bits:
            raise BadInput(f"qweight rows {qshape[0]} do not hold whole {bits}-bit codes", path=where, tensor=qweight_name)
        self._check_config_dims(prefix, in_features, out_features, where, qweight_name, bits)
        n_groups = scales.shape[0]
        group_size = scheme.group_size if scheme.group_size > 0 else in_features
        if scales.shape[1] != out_features:
            raise BadInput(f"scales shape {tuple(scales.shape)} does not match qweight {tuple(qshape)}",
                           path=self.ckpt.file_of(parts["scales"]), tensor=parts["scales"])
        if in_features % group_size or n_groups != in_features // group_size:
            raise BadInput(f"{n_groups} scale groups do not match in_features {in_features} with group_size "
                           f"{scheme.group_size}", path=self.ckpt.file_of(parts["scales"]), tensor=parts["scales"])
        if tuple(qzeros.shape) != (n_groups, out_features * bits // 32):
            raise BadInput(f"qzeros shape {tuple(qzeros.shape)} does not match {n_groups} groups x {out_features} "
                           f"outputs at {bits} bits", path=self.ckpt.file_of(parts["qzeros"]), tensor=parts["qzeros"])
        zeros = decode_zeros(qzeros, bits, self.convention)
        self._check_convention(zeros, bits, self.ckpt.file_of(parts["qzeros"]), parts["qzeros"])
        g_idx = None
        if "g_idx" in parts:
            g = self.ckpt.get(parts["g_idx"]).to(torch.int64)
            if tuple(g.shape) != (in_features,) or (g.numel() and (int(g.min()) < 0 or int(g.max()) >= n_groups)):
                raise BadInput(f"g_idx shape {tuple(g.shape)} or range does not match {in_features} inputs and "
                               f"{n_groups} groups", path=self.ckpt.file_of(parts["g_idx"]), tensor=parts["g_idx"])
            natural = torch.arange(in_features, dtype=torch.int64) // group_size
            g_idx = None if torch.equal(g, natural) else g
        params = GridParams(bits=bits, group_size=group_size, scales=scales.T.contiguous(),
                            zeros=zeros.T.contiguous(), g_idx=g_idx)
        return params, (out_features, in_features), qweight_name

    def _check_config_dims(self, prefix, in_features, out_features, where, tensor, bits):
        hidden = self.config.get("hidden_size")
        inter = self.config.get("intermediate_size")
        expect = None
        if hidden and _IN_FROM_HIDDEN.search(prefix):
            expect = hidden
        elif inter and _IN_FROM_INTERMEDIATE.search(prefix):
            expect = inter
        if expect is not None and in_features != expect:
            raise BadInput(f"qweight shape implies in_features {in_features} at {bits} bits, but config.json says "
                           f"{expect}", path=where, tensor=tensor)

    def _check_convention(self, zeros: torch.Tensor, bits: int, where: Path, tensor: str) -> None:
        mid = 1 << (bits - 1)
        if not bool((zeros == zeros.flatten()[0]).all()):
            return  # asymmetric: the data cannot tell v1 from v2, the label stands
        z = int(zeros.flatten()[0])
        label = "gptq_v2" if self.convention == "v2" else "gptq"
        if self.convention == "v2" and z == mid - 1:
            raise BadInput(f"config says checkpoint_format {label!r} but every zero point reads {z}, the v1 "
                           f"convention for symmetric {bits}-bit ({mid} stored as {mid - 1}); set checkpoint_format "
                           "to \"gptq\"", path=where, tensor=tensor)
        if self.convention == "v1" and z == (mid + 1) % (1 << bits):
            raise BadInput(f"config says checkpoint_format {label!r} but every zero point reads {z}, i.e. the "
                           f"fields hold {mid}, the v2 convention; set checkpoint_format to \"gptq_v2\"",
                           path=where, tensor=tensor)

    def _load_grid(self, prefix: str) -> Grid:
        params, (out_features, in_features), qweight_name = self._params(prefix)
        qweight = self.ckpt.get(qweight_name)
        if qweight.dtype != torch.int32:
            raise BadInput(f"qweight dtype {qweight.dtype} is not int32", path=self.ckpt.file_of(qweight_name),
                           tensor=qweight_name)
        return Grid(params, packed=PackedCodes(qweight, params.bits, "gptq-rows"))

    # -- rotation (shared spec gptq_qqq.md section 4) -----------------------------------------------
    def _folded_record(self, prefix: str, shard: str) -> TensorRecord:
        """A down_proj of a rotated checkpoint: gptqmodel re-applies a Hadamard M to its input at run time
        (y = W_q (x M)), so the weight that means the same thing without that step is W_q M^T, a float
        tensor off the grid. It is yielded as that Dense tensor (what every target sees), with the stored
        grid kept in `notes` for a target that carries the rotation itself (GPTQ / GPTQ-v2 output)."""
        params, shape, qweight_name = self._params(prefix)
        try:
            require_foldable(shape[1])
        except UnsupportedHadamard as e:
            raise BadInput(f"rotation {self.rotation!r}: {e}", path=self.ckpt.file_of(qweight_name),
                           tensor=qweight_name) from None
        standin = (f"rotation {self.rotation!r}: gptqmodel re-applies a Hadamard transform to down_proj's input at "
                   f"run time and the target has no equivalent, so it is folded into the weights (W M^T), which "
                   f"leaves the {params.bits}-bit grid")
        return TensorRecord(f"{prefix}.weight", shape, "float32",
                            lambda p=prefix: Dense(fold_online_hadamard(self._load_grid(p).dequantize(torch.float32))),
                            source_file=shard,
                            notes={"lossy_standin": standin, "rotation": self.rotation, "rotated_params": params,
                                   "rotated_grid": lambda p=prefix: self._load_grid(p)})

    # -- the ModelSource interface ----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        consumed = {n for parts in self.modules.values() for p, n in parts.items() if p != "qweight"}
        for shard in self.ckpt.shards:
            for name in self.ckpt.keys(shard):
                if name in consumed:
                    continue
                prefix, _, part = name.rpartition(".")
                if part == "qweight" and self.rotation and _ONLINE_HADAMARD.search(prefix):
                    yield self._folded_record(prefix, shard)
                elif part == "qweight":
                    params, shape, _ = self._params(prefix)
                    yield TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p),
                                       params=params, source_file=shard)
                else:
                    yield self.ckpt.dense_record(name, shard)

    def side_files(self) -> dict[str, Path]:
        return self.ckpt.side_files()

    def describe(self) -> dict:
        qc = self.quant_config
        desc = {"format": self.format_name, "zero_convention": self.convention,
                "bits": qc.get("bits"), "group_size": qc.get("group_size"), "sym": qc.get("sym"),
                "desc_act": qc.get("desc_act"), "dynamic": qc.get("dynamic") or {},
                "shards": len(self.ckpt.shards), "quantized_modules": len(self.modules),
                "layout": "qweight int32 [in*b/32, out] packed along inputs; qzeros [G, out*b/32]; scales fp16 [G, out]"}
        if self.rotation:
            desc["rotation"] = (f"{self.rotation}: online Hadamard before mlp.down_proj, folded into it on reading "
                                "(kept as is for GPTQ output)")
        return desc


ROTATIONS = ("hadamard", "random")  # gptqmodel's modes; both leave the same online Hadamard on down_proj
_ONLINE_HADAMARD = re.compile(r"(^|\.)mlp\.down_proj$")


def _rotation_mode(qc: dict, config: dict, where: Path) -> str | None:
    """The checkpoint's `rotation` (None when absent); unknown modes and unsupported sizes are refused."""
    mode = qc.get("rotation")
    if mode in (None, "", False):
        return None
    if mode not in ROTATIONS:
        raise BadInput(f"unknown rotation {mode!r}: gptqmodel defines {' and '.join(map(repr, ROTATIONS))}; "
                       "without knowing the run-time transform the weights cannot be read", path=where)
    return str(mode)


def open_gptq(path: Path, **_: object) -> GptqSource:
    return GptqSource(path)


# ---------------------------------------------------------------------------------------------------
# Writer

_TYPE_RE = re.compile(r"^(?:gptq:)?(?:b|q)?(?P<bits>[2348])(?:bit)?[-_:]?g(?P<group>-?\d+)(?P<asym>a|-asym)?$")


def parse_gptq_type(text: str) -> ModuleScheme:
    """`4g128` / `q4g128` / `4bit-g128` (sym), `4g32a` (asym), `8g-1` (per-channel)."""
    m = _TYPE_RE.match(text.strip().lower())
    if not m:
        raise QConvertError(f"unknown GPTQ type {text!r}; write bits and group, e.g. 4g128, 4g32a (asym), 8g-1")
    return ModuleScheme(int(m["bits"]), int(m["group"]), not m["asym"], False)


class GptqWriter:
    """Writes a GPTQ checkpoint directory in the v1 or v2 zero convention, loadable by gptqmodel."""

    output_is_file = False

    def __init__(self, convention: str):
        self.convention = convention
        self.name = "gptq-v2" if convention == "v2" else "gptq"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        if rec.notes.get("rotated_grid") is not None:
            return self._plan_rotated(rec, options, source)
        explicit = options.explicit_type(rec.name) or options.type
        if rec.is_grid:
            p = rec.params
            src = describe_grid(p, rec.shape[1])
            # GPTQ quantizes linears only: a quantized embedding (GGUF token_embd), or an output head it
            # cannot hold as it is (GGUF Q6_K), is stored dequantized in fp16, as GPTQ models keep them
            if _EMBEDDING.search(rec.name) or (rec.name == "lm_head.weight" and self._check_grid(p).verdict != EXACT):
                v = check_grid_to_float(p, "F16")
                return TensorPlan(rec.name, rec.shape, src, "float16", v.verdict,
                                  f"kept unquantized as in GPTQ models: {v.reason}", out_name=rec.name,
                                  info={"dense": torch.float16})
            if explicit:
                want = parse_gptq_type(explicit)
                same = (want.bits == p.bits and (want.group_size if want.group_size > 0 else rec.shape[1]) == p.group_size
                        and (want.sym == p.symmetric or not want.sym))
                if not same:
                    info = {"scheme": want}
                    view = rec.notes.get("four_bit_view")  # a source's own 4-bit form of the tensor (QQQ grouped)
                    if view is not None and want.bits == 4 and want.sym and want.group_size == view[0]:
                        info["grid_view"] = view[1]
                    return TensorPlan(rec.name, rec.shape, src, explicit, REQUANTIZE, "type differs from the source grid"
                                      + ("; the source's own 4-bit codes are kept" if "grid_view" in info else ""),
                                      alternative=f"--type {p.bits}g{p.group_size}", out_name=rec.name, info=info)
            v = self._check_grid(p)
            target = f"gptq {p.bits}-bit g{p.group_size}" if p.n_groups > 1 else f"gptq {p.bits}-bit per-channel"
            if v.verdict == REFUSED and self.convention == "v1" and not p.symmetric and p.integer_zeros:
                return TensorPlan(rec.name, rec.shape, src, target, REFUSED, v.reason, alternative="gptq-v2 output (exact)",
                                  out_name=rec.name)
            info = {}
            if v.verdict == REQUANTIZE:
                info["scheme"] = ModuleScheme(p.bits if p.bits in SUPPORTED_PACK_BITS else 4,
                                              p.group_size if p.n_groups > 1 else -1, False, False)
            return TensorPlan(rec.name, rec.shape, src, target, v.verdict, v.reason, out_name=rec.name, info=info)
        if explicit and len(rec.shape) == 2 and _DENSE_LINEAR.match(rec.name):
            want = parse_gptq_type(explicit)
            return TensorPlan(rec.name, rec.shape, rec.dtype, explicit, REQUANTIZE,
                              "dense weights quantized with round-to-nearest (no calibration)",
                              out_name=rec.name, info={"scheme": want})
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)

    def _plan_rotated(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        """A rotated down_proj: GPTQ carries the rotation itself, so the stored (rotated) grid is planned as
        any grid and the `rotation` key goes into the output config; gptqmodel re-applies the transform."""
        p = rec.notes["rotated_params"]
        grid_rec = TensorRecord(rec.name, rec.shape, "grid", rec.notes["rotated_grid"], params=p)
        plan = self.plan_tensor(grid_rec, options, source)
        plan.source = f"{plan.source} rotated ({rec.notes['rotation']})"
        plan.target = f"{plan.target} + online Hadamard (rotation kept)"
        plan.info.update(keeps_source_form=True, rotated_grid=rec.notes["rotated_grid"], rotation=rec.notes["rotation"])
        return plan

    def _check_grid(self, p: GridParams) -> Verdict:
        if p.axis != 1 or not p.integer_zeros or p.bits not in SUPPORTED_PACK_BITS:
            return Verdict(REQUANTIZE, "GPTQ holds integer zero points at 2/3/4/8 bits only")
        if p.scales.dtype != torch.float16:
            from ..converters.align import fp16_exact
            if not fp16_exact(p.scales):
                return Verdict(REQUANTIZE, "scales are not representable in fp16")
        if self.convention == "v1" and not p.symmetric:
            return Verdict(REFUSED, "asymmetric v1 cannot store a zero point of 0 without borrowing, and gptqmodel "
                                    "loads asymmetric v1 only from its own files")
        return Verdict(EXACT, "codes, zeros and fp16 scales kept")

    def check_model(self, source, plans, options) -> None:
        return None

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "GptqSession":
        return GptqSession(self, Path(path), source, plans)


class GptqSession:
    """Streams GPTQ tensors into safetensors shards; writes config and side files at the end."""

    def __init__(self, writer: GptqWriter, path: Path, source, plans: list[TensorPlan]):
        self.writer, self.path, self.source = writer, path, source
        self.shards = ShardWriter(path)
        self.schemes: dict[str, ModuleScheme] = {}
        self.dense_linears: list[str] = []
        self.rotation: str | None = None

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        rotated = plan.info.get("rotated_grid")
        if rotated is not None:
            # `item` is the folded stand-in; store the rotated grid and keep the rotation in the config.
            # What gptqmodel computes from it is the grid with the transform folded: return that to measure.
            item, self.rotation = rotated(), plan.info["rotation"]
        if "dense" in plan.info:
            item = Dense(item.dequantize(plan.info["dense"]))
        elif "grid_view" in plan.info:
            item = plan.info["grid_view"]()
        elif plan.verdict == REQUANTIZE:
            scheme = plan.info["scheme"]
            w = item.dequantize(torch.float32)
            item = Grid(*quantize_rtn(w, scheme.bits, scheme.group_size, scheme.sym))
        if isinstance(item, Grid):
            prefix = plan.name[: -len(".weight")] if plan.name.endswith(".weight") else plan.name
            self._add_grid(prefix, item)
            decoded = item.dequantize(torch.float32)
            return fold_online_hadamard(decoded) if rotated is not None else decoded
        if len(plan.shape) == 2 and _DENSE_LINEAR.match(plan.name):
            self.dense_linears.append(plan.name[: -len(".weight")])
        self.shards.put(plan.name, item.tensor)
        return item.tensor.to(torch.float32)

    def _add_grid(self, prefix: str, grid: Grid) -> None:
        p = grid.params
        out_features, in_features = grid.shape
        put = self.shards.put
        packed = grid.packed
        if packed is not None and packed.layout == "gptq-rows" and packed.bits == p.bits:
            put(f"{prefix}.qweight", packed.words)  # same packing: the source words as they are
        else:
            put(f"{prefix}.qweight", pack_rows(grid.codes.T.contiguous(), p.bits))
        put(f"{prefix}.qzeros", encode_zeros(p.zeros.T.contiguous(), p.bits, self.writer.convention))
        put(f"{prefix}.scales", p.scales.T.contiguous().to(torch.float16))
        put(f"{prefix}.g_idx", p.group_of_column(in_features).to(torch.int32))
        group = p.group_size if p.n_groups > 1 else -1
        self.schemes[prefix] = ModuleScheme(p.bits, group, p.symmetric, not p.contiguous_groups(in_features))

    def close(self) -> None:
        self.shards.close()
        qc = self._quant_config()
        write_json(self.path / "config.json", {**self.source.config, "quantization_config": qc})
        write_json(self.path / "quantize_config.json", qc)
        copy_side_files(self.source, self.path)

    def _quant_config(self) -> dict:
        if not self.schemes:
            raise QConvertError("nothing to write as GPTQ: the source has no quantized tensors (pass --type, e.g. 4g128)")
        counts: dict[ModuleScheme, int] = {}
        for s in self.schemes.values():
            counts[s] = counts.get(s, 0) + 1
        base = max(counts, key=counts.get)
        fmt = "gptq_v2" if self.writer.convention == "v2" else "gptq"
        dynamic = {}
        for prefix, s in self.schemes.items():
            if s != base:
                dynamic[f"+:^{re.escape(prefix)}$"] = {"bits": s.bits, "group_size": s.group_size, "sym": s.sym,
                                                      "desc_act": s.desc_act}
        for prefix in self.dense_linears:
            dynamic[f"-:^{re.escape(prefix)}$"] = {}
        qc = {"bits": base.bits, "group_size": base.group_size, "desc_act": base.desc_act, "sym": base.sym,
              "lm_head": "lm_head" in self.schemes, "method": "gptq", "quant_method": "gptq",
              "format": fmt, "checkpoint_format": fmt, "pack_dtype": "int32",
              "meta": {"quantizer": [f"qconvert:{__version__}"]}}
        if dynamic:
            qc["dynamic"] = dynamic
        if self.rotation:
            qc["rotation"] = self.rotation
        return qc


def _sniff(convention: str):
    def sniff(path: Path) -> bool:
        qc = quantization_config_of(path)
        if not qc or str(qc.get("quant_method", qc.get("method", ""))).lower() != "gptq":
            return False
        try:
            return _zero_convention(qc) == convention
        except BadInput:
            return False
    return sniff


register_format(FormatEntry("gptq", aliases=("gptq-v1", "autogptq"),
                            description="GPTQ checkpoint, v1 zero-point convention (stored zero = z - 1)",
                            open_reader=open_gptq, writer=GptqWriter("v1"), sniff=_sniff("v1")))
register_format(FormatEntry("gptq-v2", aliases=("gptqv2",),
                            description="GPTQ checkpoint, v2 convention (true zero points)",
                            open_reader=open_gptq, writer=GptqWriter("v2"), sniff=_sniff("v2")))
