"""What the readers of float-quantized checkpoints share (formats/fp8, formats/modelopt, formats/mxfp4 and the
compressed-tensors reader): the float grid a module becomes, from its stored element codes and scales.

A float grid (converters/records.py) is a codebook grid whose table is the element format's values in code
order (kernels/floatq.py), its scales in the dtype the file stores, `block_rows` > 1 where one scale covers
several output rows (expanded to one scale row per output row here, so every consumer sees [out, groups]).
"""

from __future__ import annotations

from pathlib import Path

import torch

from typing import Iterator

from ...converters.errors import BadInput
from ...converters.records import GridParams, TensorRecord, unused_zeros
from ...kernels.floatq import element_table
from .checkpoint import CheckpointSource

__all__ = ["FP8_ELEMENTS", "fp8_element", "float_grid", "expand_block_rows", "block_grid_shape", "RuntimeScales",
           "FloatModuleSource", "refuse_unscaled_fp8"]

# safetensors' dtype tags of FP8 weights -> their element format
FP8_ELEMENTS = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}


def fp8_element(dtype: str, where: Path, tensor: str) -> str:
    """"e4m3" / "e5m2" for an FP8 weight's safetensors dtype, else one BadInput naming the tensor."""
    if dtype not in FP8_ELEMENTS:
        raise BadInput(f"dtype {dtype} is not an FP8 weight ({' or '.join(FP8_ELEMENTS)})", path=where, tensor=tensor)
    return FP8_ELEMENTS[dtype]


def block_grid_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of [rows, columns] blocks over a weight, edge blocks partial (DeepSeek's ceil division)."""
    return -(-out_features // block[0]), -(-in_features // block[1])


def expand_block_rows(scales: torch.Tensor, out_features: int, block_rows: int) -> torch.Tensor:
    """[ceil(out/b), G] block scales -> [out, G]: every output row gets the scale row of its block."""
    if block_rows == 1:
        return scales.contiguous()
    return scales.repeat_interleave(block_rows, dim=0)[:out_features].contiguous()


def refuse_unscaled_fp8(ckpt, scaled: set[str], scale_part: str) -> None:
    """Every FP8 tensor of a float-quantized checkpoint is a weight's codes, which mean a value only times the
    scale stored beside them: one that is not among `scaled` (the tensors of the modules found with their
    scale) lost its `scale_part`. Written as it is it would pass for weights of |w| up to 448, so it is a
    BadInput naming its file and tensor, before any target is planned."""
    for name in ckpt.location:
        dtype = ckpt.dtype(name)
        if dtype in FP8_ELEMENTS and name not in scaled:
            raise BadInput(f"missing {scale_part} for this FP8 weight (its {dtype} codes are values only times that "
                           "scale)", path=ckpt.file_of(name), tensor=name)


def float_grid(element: str, scales: torch.Tensor, group_size: int, *, global_scale: torch.Tensor | None = None,
               global_scale_op: str = "mul", block_rows: int = 1, negative_zero: bool = True) -> GridParams:
    """GridParams of a float grid: codes index `element`'s values, times `scales` [out, groups] (their stored
    dtype kept), with an optional per-tensor scale applied as `global_scale_op` says. `negative_zero`: how the
    producer decodes E2M1's code 8 (kernels/floatq.element_table)."""
    bits = 4 if element == "e2m1" else 8
    return GridParams(bits=bits, group_size=group_size, scales=scales,
                      zeros=unused_zeros(scales.shape),
                      codebook=element_table(element, negative_zero=negative_zero),
                      global_scale=None if global_scale is None else global_scale.reshape(()).to(torch.float32),
                      global_scale_op=global_scale_op, block_rows=block_rows)


class RuntimeScales:
    """A checkpoint's activation and KV-cache scale tensors (`runtime_params`: their names), which describe how
    a runtime quantizes activations, not the weights: not carried, and said so (ModelSource.not_carried)."""

    runtime_params: list[str]

    @property
    def not_carried(self) -> dict[str, str]:
        return {n: "activation/KV-cache scales: a runtime's choice, not weights" for n in self.runtime_params}

    def describe_runtime(self, desc: dict) -> dict:
        if self.runtime_params:
            desc["activation_quantization"] = (f"{len(self.runtime_params)} activation/kv-cache scale tensors "
                                               "(a runtime's choice) are not carried")
        return desc


class FloatModuleSource(RuntimeScales, CheckpointSource):
    """What the FP8 and ModelOpt readers share: `modules` (prefix -> {part: tensor name}, the float grid's
    `weight` among them), each a record made by `_params(prefix)` -> (GridParams, shape) and loaded by
    `_load(prefix)`, every other tensor dense, the runtime scales left out."""

    modules: dict[str, dict[str, str]]

    def records(self) -> Iterator[TensorRecord]:
        runtime = set(self.runtime_params)
        for rec in self.module_records(self.modules, "weight", self._record):
            if rec.name not in runtime:
                yield rec

    def _record(self, prefix: str, shard: str) -> TensorRecord:
        # the parameters are parsed here for the shape and the module's checks, held until the record is
        # planned, then read again where used (`params_loader`): a giant FP8 model's block scales are not all
        # held from planning to writing
        params, shape = self._params(prefix)
        rec = TensorRecord(f"{prefix}.weight", shape, "grid", lambda p=prefix: self._load(p), source_file=shard,
                           params_loader=lambda p=prefix: self._params(p)[0])
        rec.params = params  # already read: the first use takes them (release_params drops them)
        return rec
