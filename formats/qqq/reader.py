"""QQQ checkpoints (gptqmodel `method/format: "qqq"`, and the QQQ repo's own `wbits` configs): W4A8.

Per quantized linear `<prefix>` (the buffers of gptqmodel 7.6's QQQ layer, nn_modules/qlinear/qqq.py):
`B` int32 [in/16, out*2] (4-bit codes in Marlin-style permuted 16x16 tiles, kernels/qqq_perm.py),
`s_channel` float32 [1, out] (permuted), `s_group` float16 [in/group, out] (permuted; grouped mode only),
optional `bias`. No zero points, no g_idx: groups are contiguous. A layer is in *grouped* mode iff the
config's group size is not -1 and differs from its in_features (a 128-wide layer of a g128 model is
packed per-channel style and has no s_group).

What the runtime computes (gptqmodel's CPU kernel QQQTorchLinear; the CUDA kernel the same up to the
clamp), with c the nibble and activations quantized to int8 per token at run time:

* per-channel: W[n, k] = s_channel[n] * 16 * signed(c)          (signed(c) = c - 16 for c >= 8)
* grouped:     W[n, k] = s_channel[n] * w8[n, k],
               w8 = clamp(round_half_even((c - 8) * s_group[k // group, n]), -128, 127)

and gptqmodel's loader casts s_channel to the model dtype (fp16) and back before the kernel sees it,
so the runtime scale is fp16(s_channel) [verified: the tests compare with gptqmodel's own runtime].

**The source dequantization of a QQQ tensor is this runtime weight, bit for bit** (kernel-exact),
represented as an ordinary grid:

* per-channel: 4-bit, zero point 8, one group per row, scale = 16 * fp16(s_channel) (an fp16 value),
  codes signed(c) + 8. A clean symmetric 4-bit grid: GPTQ 4-bit per-channel and GGUF Q4_0 hold it exactly.
* grouped: the int8 clamp makes the runtime weights an int8 grid with a per-channel scale:
  8-bit, zero point 128, one group per row, scale fp16(s_channel), codes w8 + 128. GPTQ 8-bit
  per-channel and GGUF Q8_0 hold it exactly. The 4-bit view (codes c, scale s_channel * s_group,
  zero 8: the "ideal" GPTQ weights, which differ from the runtime by up to 0.5 * s_channel plus the
  clamp) stays available through `QqqSource.four_bit_grid()` for a target that wants it.

Writing QQQ: a 4-bit symmetric grid with one group per row converts exactly (s_channel = scale/16);
a 4-bit symmetric g128 grid converts exactly only if every group scale of a row is an integer multiple
(<= 16) of one fp16 channel scale, otherwise its codes are kept and only the second-level scale is
rounded to int8 steps (`requantize`, measured); anything else is re-quantized (round to nearest) first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from ... import __version__
from ...converters.checker import (EXACT, REFUSED, REQUANTIZE, Decision, TargetScheme, check, check_grid_to_float,
                                describe_grid, register_family)
from ...converters.errors import BadInput, QConvertError
from ...converters.plan import Options, TensorPlan
from ...converters.records import Dense, FourBitView, Grid, GridParams, QqqLayer, TensorRecord
from ...converters.registry import FormatEntry, register_format
from ...converters.validate import ConfigView
from ...kernels.qqq_perm import (CHANNEL_SCALE_PERM, GROUP_SCALE_PERM, check_qqq_dims, pack_qqq_codes,
                                permute_chunks, qqq_codes, unpermute_chunks)
from ..gptq.reader import config_bits
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import (CheckpointDir, CheckpointSource, ShardWriter, copy_side_files, quantization_config_of,
                              read_json, write_json)

__all__ = ["QqqSource", "QqqWriter", "qqq_runtime_grid", "qqq_group_size"]

_PARTS = ("B", "s_channel", "s_group")
_LAYER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
SUPPORTED_GROUPS = (-1, 128)
INT8_STEPS = 16  # the largest second-level scale that keeps (c - 8) * s_group inside int8


def _method(qc: dict) -> str:
    if not isinstance(qc, dict):
        return ""
    return str(qc.get("quant_method", qc.get("method", ""))).lower()


def _synonym(qc: dict, key: str, legacy: str) -> str:
    """The key a config uses: gptqmodel's name, else the QQQ repo's (`wbits`, `q_group_size`)."""
    return key if qc.get(key) is not None or legacy not in qc else legacy


def qqq_group_size(qc: dict, path: Path | None = None, prefix: str = "") -> int:
    """The config's group size (-1 when absent or null), an integer or a BadInput naming the key."""
    return ConfigView(qc, path, prefix).int(_synonym(qc, "group_size", "q_group_size"), default=-1, lo=-1,
                                            hi=2**31 - 1)


def _mode(group_size: int, in_features: int) -> str:
    return "grouped" if group_size not in (-1, in_features) else "channel"


def runtime_channel_scale(s_channel_true: torch.Tensor) -> torch.Tensor:
    """The per-channel scale gptqmodel's fp16 runtime multiplies with: fp16(s_channel), [out] fp16."""
    return s_channel_true.to(torch.float32).to(torch.float16)


def qqq_runtime_grid(B: torch.Tensor, mode: str, s_channel_true: torch.Tensor, s_group_true: torch.Tensor | None,
                     group_size: int) -> Grid:
    """The kernel-exact grid of one QQQ linear from its stored `B` words and unpermuted scales (s_channel [out],
    s_group [out, G] or None for per-channel mode). Grouped mode's codes are the runtime int8 weights + 128
    (kernels/qqq_perm.qqq_codes with s_group: the clamp)."""
    s_rt = runtime_channel_scale(s_channel_true)
    if s_group_true is None:
        codes4 = qqq_codes(B, mode)
        out_features, in_features = codes4.shape
        scale = (s_rt.to(torch.float32) * 16).to(torch.float16)  # a power-of-two multiple: exact in fp16
        params = GridParams(bits=4, group_size=in_features, scales=scale[:, None],
                            zeros=torch.full((out_features, 1), 8, dtype=torch.int16))
        return Grid(params, codes=codes4 ^ 8)  # signed(c) + 8 == c xor 8 for 4-bit two's complement
    runtime_codes = qqq_codes(B, mode, s_group_true, group_size)
    out_features, in_features = runtime_codes.shape
    params = GridParams(bits=8, group_size=in_features, scales=s_rt[:, None],
                        zeros=torch.full((out_features, 1), 128, dtype=torch.int16))
    return Grid(params, codes=runtime_codes)


class QqqSource(CheckpointSource):
    """A QQQ checkpoint directory, read lazily tensor by tensor."""

    format_name = "qqq"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        cfg = read_json(self.path / "config.json")
        where, prefix = self.path / "config.json", "quantization_config."
        qc = ConfigView(cfg, where).view("quantization_config", default=None)
        if (qc is None or not qc.data) and (self.path / "quantize_config.json").exists():
            where, prefix = self.path / "quantize_config.json", ""
            qc = ConfigView(read_json(where), where)
        qc = qc.data if qc is not None else {}
        if _method(qc) != "qqq":
            raise BadInput(f"quant_method is {_method(qc) or 'missing'!r}, not qqq", path=where)
        self.quant_config = qc
        self.config = {k: v for k, v in cfg.items() if k != "quantization_config"}
        self.shapes = ModelShapes(self.config, self.path / "config.json")
        view = ConfigView(qc, where, prefix)
        bits_key = _synonym(qc, "bits", "wbits")
        bits = config_bits(view, bits_key, default=4)
        if bits != 4:
            raise BadInput(f"QQQ holds 4-bit weights only; config says {prefix}{bits_key} {bits}", path=where)
        if not view.bool("sym", default=True):
            raise BadInput(f"QQQ is symmetric only; config says {prefix}sym false", path=where)
        self.group_size = qqq_group_size(qc, where, prefix)
        if self.group_size not in SUPPORTED_GROUPS:
            raise BadInput(f"QQQ group_size {self.group_size} is not -1 or 128", path=where)
        if qc.get("rotation"):
            raise BadInput(f"a QQQ checkpoint with rotation {qc['rotation']!r}: gptqmodel loads rotation only for "
                           "GPTQ formats, so what it means here is undefined", path=where)
        if qc.get("dynamic"):
            raise BadInput("per-module `dynamic` overrides in a QQQ checkpoint are not supported", path=where)
        self.modules = self.ckpt.group_modules(_PARTS, primary="B")

    # -- one module -----------------------------------------------------------------------------
    def _geometry(self, prefix: str) -> tuple[int, int, str]:
        parts = self.modules[prefix]
        b_name = parts["B"]
        where = self.ckpt.file_of(b_name)
        shape = self.ckpt.shape(b_name)
        if len(shape) != 2 or shape[1] % 2:
            raise BadInput(f"B shape {tuple(shape)} is not [in/16, out*2]", path=where, tensor=b_name)
        if self.ckpt.dtype(b_name) != "I32":
            raise BadInput(f"B dtype {self.ckpt.dtype(b_name)} is not int32", path=where, tensor=b_name)
        in_features, out_features = shape[0] * 16, shape[1] // 2
        self.shapes.check_linear(prefix, out_features, in_features, where, b_name, f"B shape {tuple(shape)}")
        why = check_qqq_dims(in_features, out_features)
        if why:
            raise BadInput(why, path=where, tensor=b_name)
        return in_features, out_features, _mode(self.group_size, in_features)

    def _scales(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor | None, int, int, str]:
        """-> (s_channel [out] fp32, s_group [out, G] fp16 or None, in, out, mode), unpermuted."""
        in_features, out_features, mode = self._geometry(prefix)
        parts = self.modules[prefix]
        if "s_channel" not in parts:
            raise BadInput("B without s_channel", path=self.ckpt.file_of(parts["B"]), tensor=f"{prefix}.s_channel")
        sc_name = parts["s_channel"]
        sc = self.ckpt.get(sc_name)
        if not torch.is_floating_point(sc) or sc.numel() != out_features or (sc.dim() == 2 and sc.shape[0] != 1):
            raise BadInput(f"s_channel {sc.dtype} {tuple(sc.shape)} is not a float [1, {out_features}]",
                           path=self.ckpt.file_of(sc_name), tensor=sc_name)
        s_channel = unpermute_chunks(sc.reshape(-1).to(torch.float32), CHANNEL_SCALE_PERM)
        if not bool(torch.isfinite(runtime_channel_scale(s_channel)).all()):
            raise BadInput("s_channel has values that are not finite in fp16", path=self.ckpt.file_of(sc_name),
                           tensor=sc_name)
        sg_name = parts.get("s_group")
        sg = self.ckpt.get(sg_name) if sg_name else None
        if mode == "channel":
            if sg is not None and sg.numel():
                raise BadInput(f"s_group {tuple(sg.shape)} in a per-channel layer (group_size {self.group_size}, "
                               f"in_features {in_features})", path=self.ckpt.file_of(sg_name), tensor=sg_name)
            return s_channel, None, in_features, out_features, mode
        n_groups = in_features // self.group_size
        if sg is None:
            raise BadInput(f"grouped layer (group_size {self.group_size}) without s_group",
                           path=self.ckpt.file_of(parts["B"]), tensor=f"{prefix}.s_group")
        if tuple(sg.shape) != (n_groups, out_features) or not torch.is_floating_point(sg):
            raise BadInput(f"s_group {sg.dtype} {tuple(sg.shape)} is not a float [{n_groups}, {out_features}]",
                           path=self.ckpt.file_of(sg_name), tensor=sg_name)
        s_group = unpermute_chunks(sg.to(torch.float16).reshape(-1), GROUP_SCALE_PERM).reshape(n_groups, out_features)
        return s_channel, s_group.T.contiguous(), in_features, out_features, mode

    def _params(self, prefix: str) -> tuple[GridParams, tuple[int, int]]:
        s_channel, s_group, in_features, out_features, mode = self._scales(prefix)
        s_rt = runtime_channel_scale(s_channel)
        if mode == "channel":
            params = GridParams(bits=4, group_size=in_features, scales=(s_rt.float() * 16).half()[:, None],
                                zeros=torch.full((out_features, 1), 8, dtype=torch.int16))
        else:
            params = GridParams(bits=8, group_size=in_features, scales=s_rt[:, None],
                                zeros=torch.full((out_features, 1), 128, dtype=torch.int16))
        return params, (out_features, in_features)

    def _words(self, prefix: str) -> torch.Tensor:
        return self.ckpt.get(self.modules[prefix]["B"])

    def _load_grid(self, prefix: str) -> Grid:
        s_channel, s_group, _, _, mode = self._scales(prefix)
        return qqq_runtime_grid(self._words(prefix), mode, s_channel, s_group, self.group_size)

    def four_bit_grid(self, prefix: str) -> Grid:
        """The 4-bit view of a linear: codes c with zero 8 and scale s_channel * s_group (grouped; the
        "ideal" weights, not the int8-rounded runtime ones) or 16 * s_channel (per-channel, = runtime)."""
        s_channel, s_group, in_features, _, mode = self._scales(prefix)
        if s_group is None:
            return qqq_runtime_grid(self._words(prefix), mode, s_channel, None, self.group_size)
        codes = qqq_codes(self._words(prefix), mode)
        scale = (s_channel[:, None] * s_group.to(torch.float32)).to(torch.float16)
        zeros = torch.full(scale.shape, 8, dtype=torch.int16)
        return Grid(GridParams(bits=4, group_size=self.group_size, scales=scale, zeros=zeros), codes=codes)

    def _view(self, prefix: str, mode: str) -> FourBitView | None:
        """The 4-bit view of a grouped layer, for a target asked for 4-bit groups of this size."""
        return FourBitView(self.group_size, lambda p=prefix: self.four_bit_grid(p)) if mode == "grouped" else None

    def raw_module(self, prefix: str) -> dict[str, torch.Tensor]:
        """The stored tensors of one linear as they are (for a QQQ -> QQQ copy)."""
        parts = self.modules[prefix]
        raw = {p: self.ckpt.get(n) for p, n in parts.items()}
        if "s_group" in raw and raw["s_group"].numel() == 0:
            del raw["s_group"]
        return raw

    # -- the ModelSource interface ----------------------------------------------------------------
    def records(self) -> Iterator[TensorRecord]:
        return self.module_records(self.modules, "B", self._module_record)

    def _module_record(self, prefix: str, shard: str) -> TensorRecord:
        params, shape = self._params(prefix)
        mode = _mode(self.group_size, shape[1])
        return TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p),
                            params=params, source_file=shard,
                            qqq_layer=QqqLayer(prefix, mode, self.group_size, lambda p=prefix: self.raw_module(p)),
                            four_bit_view=self._view(prefix, mode))

    def describe(self) -> dict:
        modes: dict[str, int] = {}
        for prefix in self.modules:
            mode = self._geometry(prefix)[2]
            modes[mode] = modes.get(mode, 0) + 1
        return {"format": "qqq", "bits": 4, "group_size": self.group_size, "sym": True,
                "quantized_modules": len(self.modules), "layer_modes": modes, "shards": len(self.ckpt.shards),
                "dequantization": "kernel-exact: per-channel 4-bit grid, scale 16*fp16(s_channel); grouped int8 grid "
                                  "clamp(round((c-8)*s_group)), scale fp16(s_channel)",
                "layout": "B int32 [in/16, out*2] Marlin tiles; s_channel fp32 [1, out]; s_group fp16 [in/g, out]",
                "ignored_files": self.ignored_files}


def open_qqq(path: Path, **_: object) -> QqqSource:
    return QqqSource(path)


# ---------------------------------------------------------------------------------------------------
# Writer

def _parse_qqq_type(text: str) -> int:
    """`g128` / `4g128` / `128` -> 128, `g-1` / `4g-1` / `-1` / `channel` -> -1."""
    key = text.strip().lower().replace("qqq:", "")
    if key in ("channel", "per-channel"):
        return -1
    m = re.match(r"^(?:4(?:bit)?[-_:]?)?g?(-1|128)$", key)
    if not m:
        raise QConvertError(f"unknown QQQ type {text!r}; QQQ holds 4-bit symmetric weights with group 128 or -1: "
                            "write g128 or g-1")
    return int(m.group(1))


def exact_channel_scale(s_g: torch.Tensor) -> torch.Tensor | None:
    """For group scales s_g [out, G] (float32 values of fp16 scales): a per-row fp16 channel scale s with
    every s_g = s * k, k an integer in 1..16, so that QQQ's int8 step reproduces the grid exactly; None if
    some row has none."""
    top = s_g.max(dim=1).values
    found = torch.zeros_like(top)
    ok = torch.zeros(top.shape, dtype=torch.bool)
    for k in range(INT8_STEPS, 0, -1):  # the largest k gives the finest channel scale
        s = (top / k).to(torch.float16).to(torch.float32)
        ratio = s_g / s[:, None]
        k_int = torch.round(ratio)
        good = ((k_int * s[:, None] == s_g).all(1) & (k_int >= 1).all(1) & (k_int <= INT8_STEPS).all(1) & (s > 0))
        take = good & ~ok
        found = torch.where(take, s, found)
        ok |= good
    return found if bool(ok.all()) else None


def covering_channel_scale(s_g: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 channel scale s >= max_g s_g / 16 (so |(c - 8) * s_g / s| <= 128: no clamp)."""
    need = s_g.max(dim=1).values / INT8_STEPS
    s = need.to(torch.float16)
    low = s.to(torch.float32) < need
    s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    tiny = torch.finfo(torch.float16).tiny
    return torch.where(s > 0, s, torch.full_like(s, tiny)).to(torch.float32)


def _qqq_decision(src, shape, s: TargetScheme, native=None, prefer=()) -> Decision:
    """The alignment checker's "qqq" family: QQQ's 4-bit symmetric codes in Marlin tiles with an fp16 channel
    scale (s.group = in_features) or an int8 group scale under an fp16 channel scale. facts["how"] says how
    the session writes it: copy (the source's own B words), channel, grouped (codes kept), rtn."""
    out_features, in_features = shape
    mode = "channel" if s.group == in_features else "grouped"
    why = check_qqq_dims(in_features, out_features)  # Marlin's tiles
    if why is None and mode == "grouped" and in_features % s.group:
        why = f"in_features {in_features} is not a multiple of the group size {s.group}"
    if why:
        return Decision(REFUSED, why)
    if native == "qqq":
        return Decision(EXACT, "B words and scales copied", copied=True, keeps_codes=True, facts={"how": "copy"})
    if not isinstance(src, GridParams):
        return Decision(REQUANTIZE, f"dense {src} weights quantized to QQQ with round-to-nearest (no calibration)",
                        facts={"how": "rtn"})
    p = src
    sym4 = p.bits == 4 and p.symmetric and p.axis == 1 and p.mins is None
    regrouped = regroup(p, in_features, s.group) if sym4 else None
    if regrouped is not None:
        facts = {"how": mode, "params": regrouped}
        if mode == "channel":
            sc = regrouped.scales.to(torch.float32)
            if torch.equal((sc / 16).to(torch.float16).to(torch.float32) * 16, sc):
                return Decision(EXACT, "codes kept; s_channel = scale/16 exact in fp16", keeps_codes=True, facts=facts)
            return Decision(REQUANTIZE, "scale/16 is not an fp16 value (gptqmodel runs s_channel in fp16)", facts=facts)
        if exact_channel_scale(regrouped.scales.to(torch.float32)) is not None:
            return Decision(EXACT, "codes kept; every group scale is an integer multiple of the channel scale",
                            keeps_codes=True, facts=facts)
        return Decision(REQUANTIZE, "codes kept; QQQ rounds (c-8)*s_group to int8 steps of a per-channel scale, "
                                    "up to half a step per weight", keeps_codes=True, facts=facts)
    return Decision(REQUANTIZE, f"{describe_grid(p, in_features)} is not QQQ's 4-bit symmetric "
                                f"{'per-channel' if mode == 'channel' else f'g{s.group} contiguous'} grid; "
                                "re-quantized (RTN)", facts={"how": "rtn"})


register_family("qqq", _qqq_decision)


def qqq_scheme(group: int, in_features: int) -> TargetScheme:
    """QQQ's target for a layer: per-channel (group -1, or a group as wide as the row) or grouped."""
    per_channel = _mode(group, in_features) == "channel"
    return TargetScheme("qqq", "qqq", bits=4, group=in_features if per_channel else group, zero="none",
                        scale="fp16" if per_channel else "int8 under fp16", offset=8)


class QqqWriter:
    """Writes a QQQ checkpoint directory loadable by gptqmodel (backend qqq / qqq_torch)."""

    name = "qqq"
    output_is_file = False

    def __init__(self, group: int | None = None):
        self._target_group = group  # set by for_conversion

    def for_conversion(self, source, options: Options) -> "QqqWriter":
        """The writer for one conversion, holding the target group (--type, else the source's own)."""
        if options.type:
            group = _parse_qqq_type(options.type)
        elif source.format_name == "qqq":
            group = source.group_size
        else:
            group = -1 if int((source.quant_config or {}).get("group_size", 128) or 128) == -1 else 128
        return QqqWriter(group)

    def _group(self, source, options: Options) -> int:
        if self._target_group is None:
            return self.for_conversion(source, options)._target_group
        return self._target_group

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        group = self._group(source, options)
        is_linear = len(rec.shape) == 2 and _LAYER_LINEAR.match(rec.name) is not None
        if not is_linear and rec.is_grid:
            # QQQ quantizes decoder-layer linears only: a quantized embedding or head is stored in fp16
            v = check_grid_to_float(rec.params, "F16")
            return TensorPlan(rec.name, rec.shape, describe_grid(rec.params, rec.shape[-1]), "float16", v.verdict,
                              f"kept unquantized as in QQQ models: {v.reason}", out_name=rec.name,
                              info={"dense": torch.float16})
        if not is_linear:
            return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)
        out_features, in_features = rec.shape
        mode = _mode(group, in_features)
        target = "qqq 4-bit " + ("per-channel" if mode == "channel" else f"g{group}")
        src = describe_grid(rec.params, in_features) if rec.is_grid else rec.dtype
        layer = rec.qqq_layer  # the source's own QQQ words, copied when the layout is the same
        native = "qqq" if (layer is not None and layer.mode == mode and layer.group_size in (group, None)) else None
        d = check(rec.params if rec.is_grid else rec.dtype, rec.shape, qqq_scheme(group, in_features), native=native)
        if d.verdict == REFUSED:
            return TensorPlan(rec.name, rec.shape, src, target, REFUSED, d.reason, out_name=rec.name)
        info = {"mode": mode, "group": group, "how": d.facts["how"]}
        if d.copied:
            info["words"] = layer.load_words
        if "params" in d.facts:
            info["params"] = d.facts["params"]
        return TensorPlan(rec.name, rec.shape, src, target, d.verdict, d.reason, out_name=rec.name, info=info)

    def check_model(self, source, plans, options) -> None:
        if not any(p.info.get("mode") for p in plans):
            raise QConvertError("nothing to write as QQQ: the source has no linear layers to quantize", path=source.path)

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "QqqSession":
        return QqqSession(Path(path), source, self._group(source, options))


class QqqSession:
    def __init__(self, path: Path, source, group: int):
        self.path, self.source, self.group = path, source, group
        self.shards = ShardWriter(path)
        self.quantized: list[str] = []
        self.dense_linears: list[str] = []

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        how = plan.info.get("how")
        if "dense" in plan.info:
            item = Dense(item.dequantize(plan.info["dense"]))
        if how is None:
            self.shards.put(plan.name, item.tensor)
            if len(plan.shape) == 2 and _LAYER_LINEAR.match(plan.name):
                self.dense_linears.append(plan.name[: -len(".weight")])
            return item.tensor.to(torch.float32)
        prefix = plan.name[: -len(".weight")]
        mode = plan.info["mode"]
        if how == "copy":
            raw = plan.info["words"]()
            tensors = {k: v for k, v in raw.items() if k in _PARTS}
        else:
            grid = item
            if "params" in plan.info:  # the same grid with its groups stated at QQQ's group size
                grid = Grid(plan.info["params"], codes=item.codes)
            if how == "rtn":
                w = item.dequantize(torch.float32)
                grid = Grid.rtn(w, 4, -1 if mode == "channel" else self.group, True)
            tensors = encode_module(grid, mode)
        for part, t in tensors.items():
            self.shards.put(f"{prefix}.{part}", t)
        self.quantized.append(prefix)
        return decode_module(tensors, mode, self.group).dequantize(torch.float32)

    def close(self) -> None:
        self.shards.close()
        qc = {"bits": 4, "group_size": self.group, "desc_act": False, "sym": True,
              "lm_head": any(p == "lm_head" for p in self.quantized), "method": "qqq", "quant_method": "qqq",
              "format": "qqq", "checkpoint_format": "qqq", "pack_dtype": "int32",
              "meta": {"quantizer": [f"qconvert:{__version__}"]}}
        if self.dense_linears:
            qc["dynamic"] = {f"-:^{re.escape(p)}$": {} for p in self.dense_linears}
        write_json(self.path / "config.json", {**self.source.config, "quantization_config": qc})
        write_json(self.path / "quantize_config.json", qc)
        copy_side_files(self.source, self.path)


def regroup(p: GridParams, in_features: int, group: int) -> GridParams | None:
    """The same grid with contiguous groups of `group` columns (`in_features` = one per row), or None when
    some target group would hold two different scales or zero points. Act-order or finer groups whose
    scales agree within every target group are thereby proven equivalent (e.g. Q4_0 blocks of a
    per-channel grid)."""
    if in_features % group:
        return None
    cols = p.group_of_column(in_features)
    per_col_s, per_col_z = p.scales[:, cols], p.zeros[:, cols]
    s = per_col_s.reshape(p.scales.shape[0], in_features // group, group)
    z = per_col_z.reshape(p.zeros.shape[0], in_features // group, group)
    if not (bool((s == s[..., :1]).all()) and bool((z == z[..., :1]).all())):
        return None
    return GridParams(bits=p.bits, group_size=group, scales=s[..., 0].contiguous(), zeros=z[..., 0].contiguous(),
                      compute_dtype=p.compute_dtype)


def encode_module(grid: Grid, mode: str) -> dict[str, torch.Tensor]:
    """A 4-bit symmetric grid (zero 8; one group per row for "channel", contiguous groups for "grouped")
    -> the QQQ tensors B, s_channel (fp32 [1, out]) and, grouped, s_group (fp16 [G, out]), all permuted."""
    p = grid.params
    codes = grid.codes
    out_features, _ = codes.shape
    s = p.scales.to(torch.float32)
    if mode == "channel":
        nibbles = (codes.to(torch.int16) - 8) & 0xF  # two's complement nibble of q - 8
        s_channel = s[:, 0] / 16
        return {"B": pack_qqq_codes(nibbles.to(torch.uint8), "channel"),
                "s_channel": permute_chunks(s_channel, CHANNEL_SCALE_PERM).reshape(1, out_features).contiguous()}
    exact = exact_channel_scale(s)
    s_channel = exact if exact is not None else covering_channel_scale(s)
    s_group = (s / s_channel[:, None]).to(torch.float16)  # gptqmodel's own rule: fp16(scale / s_channel)
    n_groups = s_group.shape[1]
    return {"B": pack_qqq_codes(codes, "grouped"),
            "s_channel": permute_chunks(s_channel, CHANNEL_SCALE_PERM).reshape(1, out_features).contiguous(),
            "s_group": permute_chunks(s_group.T.contiguous(), GROUP_SCALE_PERM).reshape(n_groups, out_features).contiguous()}


def decode_module(tensors: dict[str, torch.Tensor], mode: str, group: int) -> Grid:
    """The runtime grid of stored QQQ tensors (the same decode the reader uses)."""
    B = tensors["B"]
    out_features = B.shape[1] // 2
    s_channel = unpermute_chunks(tensors["s_channel"].reshape(-1).to(torch.float32), CHANNEL_SCALE_PERM)
    s_group = None
    if mode == "grouped":
        sg = tensors["s_group"]
        s_group = unpermute_chunks(sg.to(torch.float16).reshape(-1), GROUP_SCALE_PERM).reshape(-1, out_features).T
    return qqq_runtime_grid(B, mode, s_channel, s_group, group)


def _sniff(path: Path) -> bool:
    qc = quantization_config_of(path)
    return bool(qc) and _method(qc) == "qqq"


register_format(FormatEntry("qqq", aliases=("qqq-w4a8",),
                            description="QQQ W4A8 checkpoint (gptqmodel / QQQ repo): Marlin-tiled int4, per-channel "
                                        "and per-group scales",
                            open_reader=open_qqq, writer=QqqWriter(), sniff=_sniff,
                            # the --type vocabulary as _parse_qqq_type reads it (QqqWriter._group's default)
                            type_help="g128 or g-1 (per-channel): QQQ holds 4-bit symmetric weights; without --type "
                                      "the source's group (128 unless the source is per-channel)",
                            examples=("qconvert 'gptq->qqq' model-gptq-4bit-per-channel/ model-qqq/",
                                      "qconvert 'hf->qqq' model/ model-qqq/ --type g128 --allow-requant")))
