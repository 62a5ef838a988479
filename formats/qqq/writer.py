"""Writing QQQ checkpoints (gptqmodel's qqq format), loadable by gptqmodel's qqq / qqq_torch backends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ... import __version__
from ...converters.checker import EXACT, REFUSED, check, check_grid_to_float
from ...converters.errors import QConvertError
from ...converters.plan import Options, TensorPlan, Writer, WriterSession
from ...converters.records import Dense, Grid, GridParams, TensorRecord
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from .layout import MODULE_PARTS, decode_module, encode_module, layout_mode
from .schemes import parse_qqq_type, qqq_scheme


_LAYER_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


@dataclass(frozen=True)
class QqqAction:
    """What the session does with one tensor: a quantized linear (`mode` set) is stored as a QQQ module `how`
    the checker said (its facts: "copy" the source's words, "rtn", or the mode itself: encode the kept codes);
    a quantized embedding or head is stored dequantized in `dense`; anything else is copied (no action)."""

    dense: torch.dtype | None = None
    mode: str = ""  # "channel" | "grouped"
    how: str = ""
    words: Callable[[], dict] | None = None  # "copy": the source module's stored tensors (NativeForm "qqq-layer")
    params: GridParams | None = None  # the grid restated at QQQ's group size, when the checker restated it


class QqqWriter(Writer):
    """Writes a QQQ checkpoint directory loadable by gptqmodel (backend qqq / qqq_torch)."""

    name = "qqq"

    def __init__(self, group: int | None = None):
        self._target_group = group  # set by for_conversion

    def for_conversion(self, source, options: Options) -> "QqqWriter":
        """The writer for one conversion, holding the target group (--type, else the source's own)."""
        if options.type:
            group = parse_qqq_type(options.type)
        elif source.format_name == "qqq":
            group = source.group_size
        else:
            group = -1 if int((source.quant_config or {}).get("group_size", 128) or 128) == -1 else 128
        return QqqWriter(group)

    def _group(self, source, options: Options) -> int:
        if self._target_group is None:  # called without for_conversion (a direct plan_tensor call)
            return self.for_conversion(source, options)._target_group
        return self._target_group

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        group = self._group(source, options)
        is_linear = len(rec.shape) == 2 and _LAYER_LINEAR.match(rec.name) is not None
        if not is_linear and rec.is_grid:
            # QQQ quantizes decoder-layer linears only: a quantized embedding or head is stored in fp16
            return self.plan(rec, check_grid_to_float(rec.params, "F16"), "float16",
                             reason_prefix="kept unquantized as in QQQ models: ", action=QqqAction(dense=torch.float16))
        if not is_linear:
            return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)
        out_features, in_features = rec.shape
        mode = layout_mode(group, in_features)
        target = "qqq 4-bit " + ("per-channel" if mode == "channel" else f"g{group}")
        layer = rec.native_form("qqq-layer")  # the source's own QQQ words, copied when the layout is the same
        same = layer is not None and layer.facts["mode"] == mode and layer.facts["group_size"] in (group, None)
        d = check(rec.params if rec.is_grid else rec.dtype, rec.shape, qqq_scheme(group, in_features),
                  native="qqq" if same else None)
        if d.verdict == REFUSED:
            return self.plan(rec, d, target)
        return self.plan(rec, d, target, action=QqqAction(mode=mode, how=d.facts["how"],
                                                          words=layer.load if d.copied else None,
                                                          params=d.facts.get("params")))

    def check_model(self, source, plans, options) -> None:
        if not any(p.action is not None and p.action.mode for p in plans):
            raise QConvertError("nothing to write as QQQ: the source has no linear layers to quantize", path=source.path)

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "QqqSession":
        return QqqSession(Path(path), source, self._group(source, options))


class QqqSession(WriterSession):
    def __init__(self, path: Path, source, group: int):
        self.path, self.source, self.group = path, source, group
        self.shards = ShardWriter(path)
        self.quantized: list[str] = []
        self.dense_linears: list[str] = []

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        action: QqqAction = plan.action or QqqAction()
        if action.dense is not None:
            item = Dense(item.dequantize(action.dense))
        if not action.mode:
            self.shards.put(plan.name, item.tensor)
            if len(plan.shape) == 2 and _LAYER_LINEAR.match(plan.name):
                self.dense_linears.append(plan.name[: -len(".weight")])
            return item.tensor.to(torch.float32)
        prefix = plan.name[: -len(".weight")]
        if action.how == "copy":
            tensors = {k: v for k, v in action.words().items() if k in MODULE_PARTS}
        else:
            grid = item
            if action.params is not None:  # the same grid with its groups stated at QQQ's group size
                grid = Grid(action.params, codes=item.codes)
            if action.how == "rtn":
                w = item.dequantize(torch.float32)
                grid = Grid.rtn(w, 4, -1 if action.mode == "channel" else self.group, True)
            tensors = encode_module(grid, action.mode)
        for part, t in tensors.items():
            self.shards.put(f"{prefix}.{part}", t)
        self.quantized.append(prefix)
        return decode_module(tensors, action.mode, self.group).dequantize(torch.float32)

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
