"""Writing HQQ checkpoints in either container, with every key hqq 0.2.8 and transformers 4.57.6 need.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ...converters.checker import EXACT, REFUSED, REQUANTIZE, check
from ...converters.errors import QConvertError
from ...converters.plan import Options, TensorPlan, Writer, WriterSession
from ...converters.records import Dense, Grid, GridParams, TensorRecord, describe_record
from ...kernels.hqq import axis0_expand, codes_to_grouped, pack_hqq, packing_for_bits, quantize_hqq
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from .layer import HqqLayer, QMODEL, DECODER_LINEAR, EMBEDDING, SUPPORTED_BITS, axis0_params
from .schemes import HQQ_KEEP, HqqScheme, axis0_layout, scheme_fits, source_scheme, parse_hqq_type


@dataclass(frozen=True)
class HqqAction:
    """How the session stores one tensor: "grid" (the source's grid kept, with the source layer's own hqq
    `flags` and the axis-0 group it was stored with), "requant" (quantized with hqq's rule at `scheme`),
    "dequant" (a quantized embedding, stored dequantized in `dtype`) or "dense" (copied)."""

    kind: str
    dtype: torch.dtype | None = None
    scheme: HqqScheme | None = None
    flags: Mapping = field(default_factory=dict)
    axis0_groups: tuple[int, ...] = ()


class HqqWriter(Writer):
    name = "hqq"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        _, scheme = parse_hqq_type(options.explicit_type(rec.name) or options.type)
        if rec.is_grid and EMBEDDING.search(rec.name):
            # hqq (and transformers' HQQ loader) quantize nn.Linear only: a quantized token embedding (UQFF
            # 1.2, GGUF) is stored as its dequantized values in the source's compute dtype, which is exact
            cd = rec.params.compute_dtype
            return TensorPlan(rec.name, rec.shape, describe_record(rec), str(cd)[6:], EXACT,
                              f"hqq quantizes linear layers only: the embedding is stored dequantized ({str(cd)[6:]})",
                              out_name=rec.name, action=HqqAction("dequant", dtype=cd))
        if rec.is_grid:
            p = rec.params
            src = describe_record(rec)
            prefer = tuple(g for g in rec.source_groups if g > 0)  # the hqq group it was stored with
            own = source_scheme(p, rec.shape, prefer)
            same = scheme is None or scheme == own
            kept = check(p, rec.shape, HQQ_KEEP, prefer_groups=prefer)
            verdict, reason = (kept.verdict, kept.reason) if same else (REQUANTIZE, "scheme differs from the source grid")
            if verdict == EXACT:
                return TensorPlan(rec.name, rec.shape, src, own.label(), EXACT, reason, out_name=rec.name,
                                  action=HqqAction("grid", flags=rec.layer_flags.get("hqq", {}), axis0_groups=prefer))
            want = scheme or HqqScheme(p.bits if p.bits in SUPPORTED_BITS else 4,
                                       p.group_size if p.axis == 1 else 64, 1)
            why = scheme_fits(want, rec.shape)
            if why:
                return TensorPlan(rec.name, rec.shape, src, want.label(), REFUSED, why, out_name=rec.name)
            alt = ""
            if not same and kept.verdict == EXACT:
                alt = f"--type {own.bits}g{own.group_size}a{own.axis} (exact)"
            return TensorPlan(rec.name, rec.shape, src, want.label(), REQUANTIZE,
                              reason + "; quantized again with hqq's rule", alternative=alt, out_name=rec.name,
                              action=HqqAction("requant", scheme=want))
        if scheme is not None and len(rec.shape) == 2 and DECODER_LINEAR.match(rec.name):
            why = scheme_fits(scheme, rec.shape)
            if why:
                return TensorPlan(rec.name, rec.shape, rec.dtype, scheme.label(), REFUSED, why, out_name=rec.name)
            return TensorPlan(rec.name, rec.shape, rec.dtype, scheme.label(), REQUANTIZE,
                              "dense weights quantized with hqq's rule (no calibration)", out_name=rec.name,
                              action=HqqAction("requant", scheme=scheme))
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name,
                          action=HqqAction("dense"))

    def style(self, source, options: Options) -> str:
        style, _ = parse_hqq_type(options.type)
        style = style or options.extra.get("hqq_style")
        if style is None:
            style = "qmodel" if source.container == "qmodel" else "safetensors"
        if style not in ("safetensors", "qmodel"):
            raise QConvertError(f"unknown HQQ container {style!r}; choose safetensors or qmodel")
        return style

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options):
        return HqqSession(Path(path), source, plans, self.style(source, options))


def _layer_state(grid: Grid, flags: Mapping, axis0_groups: tuple[int, ...]) -> dict:
    """The HQQLinear state (python values) of one grid: codes packed, scale/zero in hqq's keepdim shapes,
    both in the compute dtype (hqq casts them to it at load, so values not exact there would change). `flags`:
    the source layer's own hqq flags (view_as_float, nbits 1.58, optimize...); `axis0_groups`: the axis-0 group
    sizes to try first."""
    p = grid.params
    out_features, in_features = shape = grid.shape
    packing = packing_for_bits(p.bits)
    cd = p.compute_dtype
    group_size, scale, zero = p.group_size, p.scales, p.zeros
    if p.axis == 0:  # the compact [1, M] meta of the hqq layout (the planner checked there is one)
        layout = axis0_layout(p, shape, axis0_groups)
        if layout is None:
            raise QConvertError(f"no hqq axis-0 layout holds scales of shape {tuple(p.scales.shape)}")
        group_size, scale, zero = layout
    words = pack_hqq(codes_to_grouped(grid.codes, group_size, p.axis), packing)
    n_groups = out_features * in_features // group_size
    keep = (n_groups, 1) if p.axis == 1 else (1, n_groups)
    scale = scale.to(cd).reshape(keep).contiguous()
    zero = zero.to(cd).reshape(keep).contiguous()
    hq = flags
    view_as_float = bool(hq.get("view_as_float", False))
    if view_as_float:
        words = words.view(cd)
    nbits = hq.get("nbits", p.bits)
    nbits = 1.58 if nbits == 1.58 else int(p.bits)
    return {"W_q": words, "nbits": nbits, "group_size": int(group_size), "shape": torch.Size(shape),
            "scale": scale, "zero": zero, "axis": int(p.axis), "packing": packing.name,
            "unpack_view_dtype": packing.storage, "view_as_float": view_as_float, "quant_scale": False,
            "quant_zero": False, "compute_dtype": cd, "offload_meta": False, "stores_quant_config": True,
            "channel_wise": bool(hq.get("channel_wise", True)), "optimize": bool(hq.get("optimize", True)),
            "round_zero": bool(hq.get("round_zero", p.bits == 4))}


def encode_value(value) -> torch.Tensor:
    """hqq's safetensors encoding (hqq/core/utils.py encode_safetensor_type)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, torch.Size):
        return torch.tensor(list(value), dtype=torch.int64)
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, bool):
        return torch.tensor(int(value), dtype=torch.uint8)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int32)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float32)
    if isinstance(value, str):
        return torch.tensor([ord(c) for c in value], dtype=torch.uint8)
    raise TypeError(type(value))


class HqqSession(WriterSession):
    """Streams HQQ layers into either container."""

    def __init__(self, path: Path, source, plans: list[TensorPlan], style: str):
        self.path, self.source, self.style = path, source, style
        self.schemes: Counter = Counter()  # (bits, group_size, axis, view_as_float, round_zero) -> layers
        self.dense_linears: list[str] = []
        self.grid_modules: set[str] = set()
        if style == "safetensors":
            self.shards = ShardWriter(path)
        else:
            # qmodel.pt is one pickle: parts go to temporary files now and are memory-mapped into it at close,
            # so the model is never held in memory
            self.parts_dir = path / ".qmodel-parts"
            self.parts_dir.mkdir()
            self.parts: list[tuple[str, str, Path]] = []  # (module, key, file)

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        action: HqqAction = plan.action
        flags, axis0_groups = (action.flags, action.axis0_groups) if action.kind == "grid" else ({}, ())
        if action.kind == "dequant":
            item = Dense(item.dequantize(action.dtype))
        if action.kind == "requant":
            s = action.scheme
            w = item.dequantize(torch.float32)
            codes, scale, zero = quantize_hqq(w, s.bits, s.group_size, s.axis)
            if s.axis == 0:
                shape = tuple(w.shape)
                params = axis0_params(s.bits, shape, axis0_expand(scale, shape, s.group_size),
                                      axis0_expand(zero, shape, s.group_size), torch.float32)
            else:
                params = GridParams(bits=s.bits, group_size=s.group_size, scales=scale.reshape(w.shape[0], -1),
                                    zeros=zero.reshape(w.shape[0], -1), axis=1, compute_dtype=torch.float32)
            item, axis0_groups = Grid(params, codes), (s.group_size,)
        if isinstance(item, Grid):
            prefix = plan.name[: -len(".weight")] if plan.name.endswith(".weight") else plan.name
            state = _layer_state(item, flags, axis0_groups)
            self._put_layer(prefix, state)
            self.grid_modules.add(prefix)
            p = item.params
            self.schemes[(p.bits, p.group_size, p.axis, state["view_as_float"], state["round_zero"])] += 1
            return self._decode_back(state, item.shape)
        tensor = item.tensor
        if len(plan.shape) == 2 and DECODER_LINEAR.match(plan.name):
            self.dense_linears.append(plan.name[: -len(".weight")])
        self._put_dense(plan.name, tensor)
        return tensor.to(torch.float32)

    def _decode_back(self, state: dict, shape) -> torch.Tensor:
        """What hqq decodes from the state written: unpack the written words and dequantize them."""
        layer = HqqLayer(state["W_q"], 2 if state["nbits"] == 1.58 else state["nbits"], state["group_size"],
                         tuple(shape), state["scale"], state["zero"], state["axis"], state["packing"],
                         state["view_as_float"], state["compute_dtype"])
        return layer.grid().dequantize(torch.float32)

    def _put_layer(self, prefix: str, state: dict) -> None:
        if self.style == "safetensors":
            for key, value in state.items():
                self.shards.put(f"{prefix}.{key}", encode_value(value))
            self.shards.put(f"{prefix}.encoded_state_dict", encode_value(True))
        else:
            self._put_part(prefix, None, state)

    def _put_dense(self, name: str, tensor: torch.Tensor) -> None:
        if self.style == "safetensors":
            self.shards.put(name, tensor)
            return
        module, _, key = name.rpartition(".")
        self._put_part(module, key, tensor)

    def _put_part(self, module: str, key: str | None, value) -> None:
        f = self.parts_dir / f"{len(self.parts):06d}.pt"
        torch.save(value, f)
        self.parts.append((module, key, f))

    def close(self) -> None:
        if not self.schemes:
            raise QConvertError("nothing to write as HQQ: the source has no quantized tensors (pass --type, e.g. 4g64)",
                                path=self.source.path)
        config = {k: v for k, v in self.source.config.items() if k != "quantization_config"}
        if self.style == "safetensors":
            self.shards.close()
            write_json(self.path / "config.json", {**config, "quantization_config": self._quant_config()})
        else:
            weights: dict[str, dict] = {}
            for module, key, f in self.parts:
                value = torch.load(str(f), weights_only=True, mmap=True)
                if key is None:
                    weights.setdefault(module, {}).update(value)
                else:
                    weights.setdefault(module, {})[key] = value
            torch.save(weights, str(self.path / QMODEL))
            del weights
            for _, _, f in self.parts:
                f.unlink()
            self.parts_dir.rmdir()
            # the hqq library writes the plain model config (with architectures) and no quantization_config
            write_json(self.path / "config.json", config)
        copy_side_files(self.source, self.path)

    def _quant_config(self) -> dict:
        bits, group_size, axis, view_as_float, round_zero = self.schemes.most_common(1)[0][0]
        weight = {"nbits": bits, "group_size": group_size, "axis": axis, "channel_wise": True, "optimize": True,
                  "round_zero": round_zero, "view_as_float": view_as_float}
        # transformers leaves skip_modules as nn.Linear and would drop a quantized lm_head's 19 keys (random
        # weights instead): lm_head is skipped only when it is not written quantized
        skip = ([] if "lm_head" in self.grid_modules else ["lm_head"]) + [m for m in self.dense_linears
                                                                        if m != "lm_head"]
        # transformers reads every layer's settings from its own tensors; quant_config, quant_method and
        # skip_modules must still be there (HqqConfig.from_dict and the loader index them)
        return {"quant_config": {"offload_meta": False, "scale_quant_params": None, "zero_quant_params": None,
                                 "weight_quant_params": weight},
                "quant_method": "hqq", "skip_modules": skip}
