"""The one intermediate every reader yields and every writer takes.

A model is a stream of `TensorRecord`s, one per logical tensor, named the way Hugging Face names them
(`model.layers.0.mlp.down_proj.weight`), in `nn.Linear` orientation `[out_features, in_features]`.
A record is either dense (a float tensor passed through as it is) or a quantization grid.

Grid convention (shared by GPTQ, HQQ axis 1, QQQ, GGUF blocks, AFQ):

    W[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)])      (zero-point form)
    W[n, k] = scales[n, g(k)] * codes[n, k] + mins[n, g(k)]         (min form: Q4_1, K types, AFQ)

where `g(k) = g_idx[k]` when an act-order index is present, else `k // group_size` (axis 1: groups run
along each output row's input features).

Axis 0 (HQQ's other layout: a group is a column of `W.reshape(group_size, -1)`, i.e. `group_size` elements
of one input column taken every R-th output row, R = out / group_size):

    W[n, k] = scales[h(n), k] * (codes[n, k] - zeros[h(n), k])      scales, zeros: [R, in]

where `h(n) = row_idx[n]` when a row index is present (rows were sliced or permuted), else `n % R`.
HQQ's own `[1, numel/gs]` scale is this `[R, in]` matrix flattened row-major (group j = h*in + k).

Codes are unpacked unsigned integers `0 .. 2**bits - 1`. Integer `zeros` mean integer zero points
(GPTQ); float `zeros` mean the float zero of HQQ. The arithmetic runs in `compute_dtype` (float32 unless
the source's own runtime rounds in fp16/bf16, as hqq does), so that the grid's dequantization is the
source's, bit for bit. A record carries its small parameters (`GridParams`: scales, zeros, g_idx)
eagerly, so that the alignment checker can decide from the data, and loads its codes only on demand,
so that a model is never held whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

__all__ = ["GridParams", "PackedCodes", "Grid", "Dense", "TensorRecord", "ModelSource", "describe_record"]


@dataclass(frozen=True)
class GridParams:
    """Everything about a quantized tensor except its codes."""

    bits: int
    group_size: int  # elements per group along the input dimension; in_features for one group per row
    scales: torch.Tensor  # [out, n_groups], the dtype the source stores (fp16 for GPTQ)
    zeros: torch.Tensor  # [out, n_groups]; integer dtype = integer zero points, float = HQQ-style
    g_idx: torch.Tensor | None = None  # [in] int64 group of each input column, None = k // group_size
    axis: int = 1  # 1: groups run along each output row's input features; 0: HQQ's strided output rows
    mins: torch.Tensor | None = None  # [out, n_groups]: min form W = s*q + m (zeros then unused)
    compute_dtype: torch.dtype = torch.float32  # the dtype the source's runtime dequantizes in
    row_idx: torch.Tensor | None = None  # axis 0 only: [out] int64 scale row of each output row, None = n % R

    @property
    def n_groups(self) -> int:
        return int(self.scales.shape[1])

    @property
    def integer_zeros(self) -> bool:
        return self.mins is None and not torch.is_floating_point(self.zeros)

    @property
    def symmetric(self) -> bool:
        """True when every zero point is the mid code 2**(bits-1): decided from the data, not a flag."""
        return self.integer_zeros and bool((self.zeros == 2 ** (self.bits - 1)).all())

    def group_of_column(self, in_features: int) -> torch.Tensor:
        """The group index of every input column, [in] int64."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(in_features, dtype=torch.int64) // self.group_size

    def contiguous_groups(self, in_features: int) -> bool:
        """True when the act-order index, if any, is the trivial k // group_size."""
        if self.g_idx is None:
            return True
        natural = torch.arange(in_features, dtype=torch.int64) // self.group_size
        return bool(torch.equal(self.g_idx, natural))

    def blocks_within_groups(self, in_features: int, block: int) -> bool:
        """True when every run of `block` consecutive input columns lies inside one group.

        This is what a block format (GGUF Q4_0 and kin) needs to hold the grid: one scale per block.
        An act-order g_idx can still satisfy it, so the question is answered from the index itself.
        """
        if in_features % block or self.axis != 1:
            return False
        cols = self.group_of_column(in_features).view(-1, block)
        return bool((cols == cols[:, :1]).all())

    def row_groups(self, out_features: int) -> torch.Tensor:
        """Axis 0: the scale row h(n) of every output row, [out] int64."""
        if self.row_idx is not None:
            return self.row_idx
        return torch.arange(out_features, dtype=torch.int64) % self.scales.shape[0]

    def _take_rows(self, index) -> "GridParams":
        if self.axis == 0:
            # axis-0 scales are shared by strided rows: keep them whole and index the rows instead
            natural = self.row_groups(self.scales.shape[0] * self.group_size)
            return replace(self, row_idx=natural[index])
        mins = None if self.mins is None else self.mins[index]
        return replace(self, scales=self.scales[index], zeros=self.zeros[index], mins=mins)

    def permute_rows(self, perm: torch.Tensor) -> "GridParams":
        return self._take_rows(perm)

    def row_slice(self, start: int, stop: int) -> "GridParams":
        return self._take_rows(slice(start, stop))


@dataclass(frozen=True)
class PackedCodes:
    """Codes as the source stores them, kept so that a writer that knows the packing can move words
    instead of unpacking codes (GPTQ 4-bit -> Q4_0). `layout` names the packing:
    "gptq-rows": int32 [in*bits/32, out], codes LSB-first along input channels;
    "ggml:<TYPE>" (e.g. "ggml:Q4_K"): uint8 [out, row_bytes], the GGUF blocks of each row as stored
    (the grid's codes come unpacked alongside; a GGUF writer of the same type copies these bytes)."""

    words: torch.Tensor
    bits: int
    layout: str

    def unpack(self) -> torch.Tensor:
        from ..kernels.bitpack import unpack_rows

        if self.layout != "gptq-rows":
            raise ValueError(f"unknown packing {self.layout!r}")
        return unpack_rows(self.words, self.bits).T.contiguous()

    def take_rows(self, index) -> "PackedCodes":
        """Select output rows (a slice or an index tensor): the words' columns for "gptq-rows", their
        rows for the row-major "ggml:" block layouts."""
        if self.layout.startswith("ggml:"):
            return PackedCodes(self.words[index], self.bits, self.layout)
        return PackedCodes(self.words[:, index], self.bits, self.layout)


class Grid:
    """A quantization grid with its codes: [out, in] uint8 codes plus `GridParams`.

    Codes may come unpacked, or packed (`PackedCodes`) and unpacked on first use.
    """

    __slots__ = ("params", "_codes", "packed")

    def __init__(self, params: GridParams, codes: torch.Tensor | None = None, packed: PackedCodes | None = None):
        if codes is None and packed is None:
            raise ValueError("a Grid needs codes or packed codes")
        self.params = params
        self._codes = codes
        self.packed = packed

    @property
    def codes(self) -> torch.Tensor:
        if self._codes is None:
            self._codes = self.packed.unpack()
        return self._codes

    @property
    def shape(self) -> tuple[int, int]:
        if self._codes is not None:
            return tuple(self._codes.shape)  # type: ignore[return-value]
        return (self.params.scales.shape[0], self.packed.words.shape[0] * 32 // self.packed.bits)

    def _take_rows(self, index, params: GridParams) -> "Grid":
        codes = None if self._codes is None else self._codes[index]
        packed = None if self.packed is None else self.packed.take_rows(index)
        return Grid(params, codes, packed)

    def permute_rows(self, perm: torch.Tensor) -> "Grid":
        return self._take_rows(perm, self.params.permute_rows(perm))

    def row_slice(self, start: int, stop: int) -> "Grid":
        return self._take_rows(slice(start, stop), self.params.row_slice(start, stop))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from ..kernels import dequantize_grid

        return dequantize_grid(self, dtype)


@dataclass(frozen=True)
class Dense:
    """A tensor that passes through as it is (embeddings, norms, biases, unquantized linears)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.tensor.to(dtype)

    def row_slice(self, start: int, stop: int) -> "Dense":
        return Dense(self.tensor[start:stop])


@dataclass
class TensorRecord:
    """One logical tensor of a source model, loaded lazily.

    `params` is set for quantized tensors (so the planner can decide without loading codes);
    `load()` returns `Dense` or `Grid` and may read from disk each time it is called.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # "grid" for quantized tensors, else the torch dtype name ("float16", ...)
    load: Callable[[], Dense | Grid]
    params: GridParams | None = None
    source_file: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def is_grid(self) -> bool:
        return self.params is not None


def describe_record(rec: "TensorRecord") -> str:
    """"4-bit g128 sym", "float16": what a record holds, for plans and reports."""
    if rec.params is None:
        return rec.dtype
    from .align import describe_grid

    return describe_grid(rec.params, rec.shape[-1])


class ModelSource(Protocol):
    """What a reader returns: config, tokenizer files and a lazy stream of tensor records."""

    path: Path
    format_name: str
    config: dict  # the model's config.json, quantization_config removed
    quant_config: dict  # the source's quantization config (empty for dense models)

    def records(self) -> Iterator[TensorRecord]:
        """Yield every tensor, shard by shard, in file order."""
        ...

    def side_files(self) -> dict[str, Path]:
        """Files to carry through (tokenizer.json, tokenizer_config.json, generation_config.json...)."""
        ...

    def describe(self) -> dict:
        """A summary for `qconvert inspect`."""
        ...
