"""Writing QQQ checkpoints (gptqmodel's qqq format), loadable by gptqmodel's qqq / qqq_torch backends.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ... import __version__
from ...converters.checker import EXACT, REFUSED, check, check_grid_to_float, describe_grid
from ...converters.errors import QConvertError
from ...converters.plan import Options, TensorPlan
from ...converters.records import Dense, Grid, TensorRecord
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from .layout import _mode, decode_module, encode_module
from .reader import _PARTS
from .schemes import _parse_qqq_type, qqq_scheme


_LAYER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")

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
