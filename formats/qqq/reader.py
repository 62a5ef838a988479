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

from pathlib import Path
from typing import Iterator

import torch

from ...converters.errors import BadInput
from ...converters.records import Grid, GridParams, NativeForm, TensorRecord
from ...converters.validate import ConfigView
from ...kernels.qqq_perm import CHANNEL_SCALE_PERM, GROUP_SCALE_PERM, check_qqq_dims, qqq_codes, unpermute_chunks
from ..common.quant_config import config_bits, read_config
from ...converters.model_shapes import ModelShapes
from ..common.checkpoint import CheckpointDir, CheckpointSource, quantization_config_of
from .layout import MODULE_PARTS, SUPPORTED_GROUPS, layout_mode, qqq_runtime_grid, runtime_channel_scale




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


class QqqSource(CheckpointSource):
    """A QQQ checkpoint directory, read lazily tensor by tensor."""

    format_name = "qqq"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = CheckpointDir(self.path)
        conf = read_config(self.path)
        view = conf.quantization(fallback="quantize_config.json")
        where, prefix = (view.path, view.prefix) if view is not None else (conf.path, "quantization_config.")
        qc = view.data if view is not None else {}
        if _method(qc) != "qqq":
            raise BadInput(f"quant_method is {_method(qc) or 'missing'!r}, not qqq", path=where)
        self.quant_config = qc
        self.config = conf.model
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
        self.modules = self.ckpt.group_modules(MODULE_PARTS, primary="B")

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
        return in_features, out_features, layout_mode(self.group_size, in_features)

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
        mode = layout_mode(self.group_size, shape[1])
        # the stored words, for a QQQ target of the same layout; a grouped layer's own 4-bit grid, for a target
        # asked for 4-bit groups of this size
        forms = (NativeForm("qqq-layer", lambda: self.raw_module(prefix),
                            {"prefix": prefix, "mode": mode, "group_size": self.group_size}),)
        if mode == "grouped":
            forms += (NativeForm("4bit-grid", lambda: self.four_bit_grid(prefix), {"group_size": self.group_size}),)
        return TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load_grid(p),
                            params=params, source_file=shard, native_forms=forms)

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


def sniff_qqq(path: Path) -> bool:
    qc = quantization_config_of(path)
    return bool(qc) and _method(qc) == "qqq"
