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

Codebook form (bitsandbytes NF4/FP4: the codes index a table of 2**bits float32 values, not a uniform grid):

    W[n, k] = scales[n, g(k)] * codebook[codes[n, k]]                 (zeros unused, mins None)

computed as bitsandbytes does: the float32 table value times the float32 block absmax, one rounding,
then cast to the output dtype.

Float grids are codebook grids whose table is a float element format (kernels/floatq.py): FP8 E4M3/E5M2
(256 codes: the byte itself), FP4 E2M1 (16 codes). Their block scales keep the dtype the source stores
(float8_e8m0fnu for MXFP4's E8M0 exponents, float8_e4m3fn for NVFP4, float32/bf16/fp16 for FP8), and may
cover `block_rows` consecutive output rows as well (DeepSeek's 128x128 FP8 blocks, expanded to one scale
row per output row here). NVFP4 adds one float32 scale for the whole tensor:

    W[n, k] = codebook[codes[n, k]] * (scales[n, g(k)] * global_scale)     "mul": ModelOpt's weight_scale_2
    W[n, k] = codebook[codes[n, k]] * (scales[n, g(k)] / global_scale)     "div": compressed-tensors' weight_global_scale
    W[n, k] = (codebook[codes[n, k]] * scales[n, g(k)]) * global_scale     "post": llama.cpp's `.scale` tensor

each step rounded to float32 in that order, as each producer's dequantization does (llama.cpp multiplies the
matmul's result by its `.scale`; the block product itself is exact).

Codes are unpacked unsigned integers `0 .. 2**bits - 1`. Integer `zeros` mean integer zero points
(GPTQ); float `zeros` mean the float zero of HQQ. The arithmetic runs in `compute_dtype` (float32 unless
the source's own runtime rounds in fp16/bf16, as hqq does), so that the grid's dequantization is the
source's, bit for bit. A record carries its small parameters (`GridParams`: scales, zeros, g_idx)
eagerly, so that the alignment checker can decide from the data, and loads its codes only on demand,
so that a model is never held whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..kernels.packings import packing

__all__ = ["unused_zeros", "GridParams", "PackedCodes", "Grid", "Dense", "TensorRecord", "NativeForm", "ModelSource", "describe_record",
           "describe_grid", "float_element", "describe_float_grid", "register_codebook", "codebook_name", "renamed"]


def unused_zeros(shape) -> torch.Tensor:
    """The `zeros` of a grid that has no zero points (codebook and float grids: the formula does not use them):
    int8 zeros of `shape` as one byte seen at every place (stride 0), so that a giant model's float grids do not
    hold a byte per group for nothing. Indexing or `.contiguous()` gives real zeros where a caller needs them."""
    return torch.zeros((), dtype=torch.int8).expand(*shape)


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
    codebook: torch.Tensor | None = None  # float32 [2**bits]: W = scales * codebook[q] (bitsandbytes NF4/FP4)
    # (a, c): the source scales in two float32 steps, W = ((q - z) * a[n, g]) * c (bitsandbytes LLM.int8:
    # a = SCB, c = 1/127 as float32); `scales` then holds fl(a * c), the one scale a target stores, which
    # decodes within an ulp of the source (one rounding instead of two) -- so no target is exact for it
    scale_steps: tuple[torch.Tensor, float] | None = None
    # float grids: one float32 scale for the whole tensor on top of the block scales (NVFP4), and whether the
    # block scales are divided by it (compressed-tensors) or multiplied (ModelOpt); see the module docstring
    global_scale: torch.Tensor | None = None
    global_scale_op: str = "mul"  # "mul" | "div" | "post": how the global scale applies (module docstring)
    block_rows: int = 1  # output rows that share one block scale in the source (DeepSeek FP8: 128)

    @property
    def element(self) -> str | None:
        """The float element format of a float grid ("e2m1", "e4m3", "e5m2"), else None."""
        return float_element(self.codebook) if self.codebook is not None else None

    def effective_scales(self) -> torch.Tensor:
        """float32 [out, n_groups]: the scale each code is multiplied by, the global scale folded in first
        ("mul", "div") as the producers do. A "post" global scale is not folded: it multiplies the product
        (`post_scale`)."""
        s = self.scales.to(torch.float32)
        if self.global_scale is None or self.global_scale_op == "post":
            return s
        g = self.global_scale.to(torch.float32)
        return s / g if self.global_scale_op == "div" else s * g

    def folded_scales(self) -> torch.Tensor:
        """float32 [out, n_groups]: one scale per group with every global scale folded in, what a target that
        stores no tensor scale keeps (equal in value; a "post" source rounds in another order)."""
        s = self.effective_scales()
        return s * self.post_scale if self.post_scale is not None else s

    @property
    def post_scale(self) -> torch.Tensor | None:
        """The float32 global scale that multiplies the block product (op "post"), else None."""
        return self.global_scale.to(torch.float32) if self.global_scale is not None and \
            self.global_scale_op == "post" else None

    @property
    def n_groups(self) -> int:
        return int(self.scales.shape[1])

    @property
    def integer_zeros(self) -> bool:
        return self.mins is None and self.codebook is None and not torch.is_floating_point(self.zeros)

    @property
    def is_codebook(self) -> bool:
        return self.codebook is not None

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
        steps = None if self.scale_steps is None else (self.scale_steps[0][index], self.scale_steps[1])
        # rows taken out of order no longer form the source's row blocks (block_rows is a description)
        return replace(self, scales=self.scales[index], zeros=self.zeros[index], mins=mins, scale_steps=steps,
                       block_rows=1)

    def permute_rows(self, perm: torch.Tensor) -> "GridParams":
        return self._take_rows(perm)

    def whole_group_order(self, columns: torch.Tensor) -> torch.Tensor | None:
        """The group order that a permutation of the input columns (new column j = old column columns[j]) is,
        when it moves whole groups in order within each (a layout's head reorder whose head width is a multiple
        of the group size): then the codes keep their groups and only the groups' parameters move. None when it
        is not (or the grid is not plain contiguous groups along the input: an act-order index, axis-0 scales,
        scales kept in two steps)."""
        gs, n = self.group_size, int(columns.numel())
        if self.axis != 1 or self.scale_steps is not None or gs <= 0 or n % gs or n // gs != self.n_groups \
                or not self.contiguous_groups(n):
            return None
        order = columns[::gs] // gs
        if not torch.equal(columns, (order[:, None] * gs + torch.arange(gs)).reshape(-1)):
            return None
        return order

    def permute_groups(self, order: torch.Tensor) -> "GridParams":
        """The parameters of the grid whose group g is this grid's group order[g] (see whole_group_order)."""
        mins = None if self.mins is None else self.mins[:, order]
        return replace(self, scales=self.scales[:, order], zeros=self.zeros[:, order], mins=mins, g_idx=None)

    def to(self, device) -> "GridParams":
        """The same parameters with every tensor on `device` (values unchanged)."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                moved[f.name] = v.to(device)
            elif f.name == "scale_steps" and v is not None:
                moved[f.name] = (v[0].to(device), v[1])
        return replace(self, **moved)

    def row_slice(self, start: int, stop: int) -> "GridParams":
        return self._take_rows(slice(start, stop))


@dataclass(frozen=True)
class PackedCodes:
    """Codes as the source stores them, kept so that a writer that knows the packing can move words
    instead of unpacking codes (GPTQ 4-bit -> Q4_0). `layout` names a packing registered in
    kernels/packings.py: "gptq-rows" (int32 [in*bits/32, out], codes LSB-first along input channels),
    "ggml:<TYPE>" (uint8 [out, row_bytes], a row's GGUF blocks as stored: the codes come unpacked
    alongside, and a GGUF writer of the same type copies these bytes)."""

    words: torch.Tensor
    bits: int
    layout: str

    def unpack(self) -> torch.Tensor:
        unpack = packing(self.layout).unpack
        if unpack is None:
            raise ValueError(f"{self.layout} words are not unpacked here (the reader gives the codes)")
        return unpack(self.words, self.bits)

    def take_rows(self, index) -> "PackedCodes":
        """Select output rows (a slice or an index tensor), as the packing lays them out."""
        return PackedCodes(packing(self.layout).take_rows(self.words, index), self.bits, self.layout)

    @property
    def in_features(self) -> int:
        return packing(self.layout).in_features(self.words, self.bits)


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
        return (self.params.scales.shape[0], self.packed.in_features)

    def _take_rows(self, index, params: GridParams) -> "Grid":
        codes = None if self._codes is None else self._codes[index]
        packed = None if self.packed is None else self.packed.take_rows(index)
        return Grid(params, codes, packed)

    def permute_rows(self, perm: torch.Tensor) -> "Grid":
        return self._take_rows(perm, self.params.permute_rows(perm))

    def permute_columns(self, columns: torch.Tensor, order: torch.Tensor) -> "Grid":
        """The grid with its input columns permuted (new column j = old column columns[j]), a permutation of
        whole groups (`order`, from GridParams.whole_group_order): the codes move, unpacked, and each group keeps
        its scale and zero, so the values are the same values moved."""
        return Grid(self.params.permute_groups(order), self.codes[:, columns].contiguous())

    def to(self, device) -> "Grid":
        """The same grid on `device` (what `--device` moves, one tensor at a time)."""
        codes = None if self._codes is None else self._codes.to(device)
        packed = None if self.packed is None else PackedCodes(self.packed.words.to(device), self.packed.bits,
                                                              self.packed.layout)
        return Grid(self.params.to(device), codes, packed)

    def row_slice(self, start: int, stop: int) -> "Grid":
        return self._take_rows(slice(start, stop), self.params.row_slice(start, stop))

    @classmethod
    def rtn(cls, w: torch.Tensor, bits: int, group_size: int, sym: bool) -> "Grid":
        """Round-to-nearest onto an integer grid (kernels/rtn.py, GPTQ's min/max range rule)."""
        from ..kernels.rtn import quantize_rtn

        scales, zeros, codes, gs = quantize_rtn(w, bits, group_size, sym)
        return cls(GridParams(bits=bits, group_size=gs, scales=scales, zeros=zeros), codes)

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


@dataclass(frozen=True)
class NativeForm:
    """A form of the tensor as its source stores it, beyond the values the record yields, for a writer that can
    keep it. `kind` names what it is, `facts` are the small values a writer checks before taking it, `load()`
    gives the form itself. The kinds readers give today:

    - "rotated-grid": the grid behind a folded stand-in (a rotated GPTQ down_proj: `lossy_standin` says why
      the values leave it); facts `params` (its GridParams) and `rotation` (gptqmodel's name, "hadamard");
      load() -> Grid. A GPTQ target carries the rotation itself and keeps this grid.
    - "qqq-layer": a QQQ module's stored tensors (B, s_channel, s_group...); facts `mode` ("channel" |
      "grouped"), `group_size`, `prefix`; load() -> {part: tensor}. A QQQ target of the same layout copies them.
    - "4bit-grid": the source's own 4-bit grid of a tensor it stores otherwise (QQQ's grouped layers: codes
      with the group scale before its int8 rounding); facts `group_size`; load() -> Grid. A target asked for
      4-bit groups of that size keeps these codes.
    - "gguf-mla-halves": a GGUF source's kv_b_proj, the float32 merge of llama.cpp's MLA halves (attn_k_b /
      attn_v_b); facts `types` (their two ggml types); load() -> (k_b record, v_b record), each the file's tensor as
      the reader reads any other. A GGUF target writes these instead of splitting the merge again.
    """

    kind: str
    load: Callable[[], Any]
    facts: Mapping[str, Any] = field(default_factory=dict)


_UNSET: Any = object()  # `params` not given: a reader's lazy record (params_loader) or a dense one


@dataclass
class TensorRecord:
    """One logical tensor of a source model, loaded lazily.

    `params` is set for quantized tensors (so the planner can decide without loading codes);
    `load()` returns `Dense` or `Grid` and may read from disk each time it is called. The typed fields
    after `source_file` are what a reader knows beyond the values, for writers that can use it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # "grid" for quantized tensors, else the torch dtype name ("float16", ...)
    load: Callable[[], Dense | Grid]
    params: GridParams | None = _UNSET  # None for a dense record; see params_loader
    source_file: str = ""
    source_name: str = ""  # the tensor's own name in the source file, when it differs (GGUF "blk.0.attn_q.weight")
    native_type: str | None = None  # the source's packed type a writer of the same type copies ("Q4_K")
    source_groups: tuple[int, ...] = ()  # the group size(s) the source stored it with (HQQ axis 0), tried first
    layer_flags: dict = field(default_factory=dict)  # format -> a layer's own flags a writer of that format carries
    lossy_standin: str = ""  # why these values are a stand-in that leaves the source's grid (see run.py)
    native_forms: tuple[NativeForm, ...] = ()  # the stored forms a writer of the source's format can keep
    # reads `params` from the source (a reader that can sets it instead of `params`): the parameters are read on
    # first use and may be dropped again (`release_params`), so that a giant model's scales are not all held
    # from planning to writing, and a split worker takes its records without reading any other tensor's
    params_loader: Callable[[], GridParams] | None = None

    def __post_init__(self) -> None:
        _post_init(self)

    @property
    def is_grid(self) -> bool:
        return self._params is not None or self.params_loader is not None

    def release_params(self) -> None:
        """Drop the parameters read so far when they can be read again (`params_loader`): the runner calls it
        once a record is planned, the write reads them again with the codes (`load`)."""
        if self.params_loader is not None:
            self._params = None

    def native_form(self, kind: str) -> NativeForm | None:
        """The source's stored form of that kind (NativeForm), or None."""
        return next((f for f in self.native_forms if f.kind == kind), None)


def _get_params(rec: TensorRecord) -> GridParams | None:
    if rec._params is None and rec.params_loader is not None:
        rec._params = rec.params_loader()
    return rec._params


def _set_params(rec: TensorRecord, params: GridParams | None) -> None:
    rec._params = None if params is _UNSET else params
    rec._params_given = params is not _UNSET


def _post_init(rec: TensorRecord) -> None:
    # parameters given (a reader's eager record, or a record derived with `replace(rec, params=...)`, which
    # passes them, None for a dense half of a grid included) are the record's own: a loader copied along from
    # the record it derives from would read the other tensor's
    if rec._params_given:
        rec.params_loader = None


# `params` is a dataclass field (the readers pass it by name) held in `_params`, read through `params_loader`
# when the record has one and the parameters are not held
TensorRecord.params = property(_get_params, _set_params)  # type: ignore[assignment]


def renamed(rec: TensorRecord, **changes) -> TensorRecord:
    """`dataclasses.replace` for a change that leaves the record's values and parameters as they are (its name,
    source name, shape label): a record that reads its parameters on use keeps its loader and reads nothing, where
    `replace` would read them and give them to the new record as its own, held from planning to writing (every
    expert of a Kimi-K3 renamed out of `language_model.`)."""
    if rec.params_loader is None or "params" in changes:
        return replace(rec, **changes)
    return replace(rec, params=_UNSET, **changes)


def describe_grid(p: GridParams, in_features: int) -> str:
    """"4-bit g128 sym", "4-bit per-channel asym act-order", "4-bit nf4 codebook blocksize 64": a grid's
    scheme in a few words."""
    if p.codebook is not None and p.element is not None:
        return describe_float_grid(p, in_features)
    if p.codebook is not None:
        return f"{p.bits}-bit {codebook_name(p.codebook)} codebook blocksize {p.group_size}"
    sym = "sym" if p.symmetric else ("asym" if p.integer_zeros else "float-zero")
    group = "per-channel" if p.n_groups == 1 else f"g{p.group_size}"
    act = "" if p.contiguous_groups(in_features) else " act-order"
    axis = "" if p.axis == 1 else f" axis {p.axis}"
    return f"{p.bits}-bit {group} {sym}{act}{axis}"


# named codebooks (a format registers the tables its producer indexes: bitsandbytes' nf4 and fp4), so that a
# codebook grid is described by name
_CODEBOOKS: dict[str, tuple[float, ...]] = {}


def register_codebook(name: str, values: tuple[float, ...]) -> None:
    """Name a codebook table (compared as float32 with a grid's table by `codebook_name`)."""
    if _CODEBOOKS.get(name, values) != values:
        raise ValueError(f"codebook {name!r} is already registered with other values")
    _CODEBOOKS[name] = tuple(values)


_FLOAT_ELEMENTS: dict[str, torch.Tensor] = {}


def float_element(codebook: torch.Tensor) -> str | None:
    """"e2m1" / "e4m3" / "e5m2" when the table is that float format's values in code order (compared bit for
    bit, the FP8 tables hold NaNs; a zero's sign aside: producers decode E2M1's code 8 as -0.0 or +0.0), else
    None."""
    from ..kernels.floatq import ELEMENT_BITS, element_table

    if not _FLOAT_ELEMENTS:
        _FLOAT_ELEMENTS.update({name: element_table(name) for name in ELEMENT_BITS})
    bits = (codebook.to(torch.float32) + 0.0).view(torch.int32)  # + 0.0: a table with +0.0 for -0.0 is the same format
    for name, table in _FLOAT_ELEMENTS.items():
        if bits.numel() == table.numel() and torch.equal(bits, (table + 0.0).view(torch.int32)):
            return name
    return None


_SCALE_NAMES = {torch.float8_e8m0fnu: "e8m0", torch.float8_e4m3fn: "e4m3", torch.float32: "fp32",
                torch.float16: "fp16", torch.bfloat16: "bf16"}
_ELEMENT_SCHEMES = {("e2m1", "e8m0", 32): "mxfp4", ("e2m1", "e4m3", 16): "nvfp4", ("e4m3", "e8m0", 32): "mxfp8"}


def describe_float_grid(p: GridParams, in_features: int) -> str:
    """"mxfp4 g32", "nvfp4 g16 global-div", "fp8-e4m3 128x128 fp32", "fp8-e4m3 channel fp16", "fp8-e4m3 tensor bf16"."""
    scale = _SCALE_NAMES.get(p.scales.dtype, str(p.scales.dtype)[6:])
    glob = "" if p.global_scale is None else f" global-{p.global_scale_op}"
    name = _ELEMENT_SCHEMES.get((p.element, scale, p.group_size))
    if name is not None:
        return f"{name} g{p.group_size}{glob}"
    s = p.scales.to(torch.float32)
    if p.n_groups == 1 and s.numel() and bool((s == s.reshape(-1)[0]).all()) and p.block_rows == 1:
        block = "tensor"
    elif p.block_rows > 1:
        block = f"{p.block_rows}x{p.group_size}"
    else:
        block = "channel" if p.n_groups == 1 else f"g{p.group_size}"
    return f"{'fp8' if p.bits == 8 else 'fp4'}-{p.element} {block} {scale}{glob}"


def codebook_name(codebook: torch.Tensor) -> str:
    """The registered name of the table ("nf4" / "fp4": bitsandbytes' own, as float32), else "custom"."""
    for name, values in _CODEBOOKS.items():
        if codebook.numel() == len(values) and torch.equal(codebook.to(torch.float32),
                                                           torch.tensor(values, dtype=torch.float32)):
            return name
    return "custom"


def describe_record(rec: "TensorRecord") -> str:
    """"4-bit g128 sym", "float16": what a record holds, for plans and reports."""
    if rec.params is None:
        return rec.dtype
    return describe_grid(rec.params, rec.shape[-1])


class ModelSource(ABC):
    """What a reader returns: config, tokenizer files and a lazy stream of tensor records.

    Every capability a writer or the runner may use is declared here with its default, so that nothing is
    looked up by name: a source overrides what it has.
    """

    path: Path
    format_name: str
    config: dict  # the model's config.json, quantization_config removed
    quant_config: dict  # the source's quantization config (empty for dense models)
    container: str = ""  # the file form it was read from when a format has several (hqq: "safetensors" | "qmodel")

    @abstractmethod
    def records(self) -> Iterator[TensorRecord]:
        """Yield every tensor, shard by shard, in file order."""

    @abstractmethod
    def side_files(self) -> dict[str, Path]:
        """Files to carry through (tokenizer.json, tokenizer_config.json, generation_config.json...)."""

    @abstractmethod
    def describe(self) -> dict:
        """A summary for `qconvert inspect`."""

    @property
    def ignored_files(self) -> dict[str, str]:
        """Weight files beside the model that are not part of it, with why."""
        return {}

    @property
    def not_carried(self) -> dict[str, str]:
        """Tensors of the model that no record carries, with why (activation and KV-cache scales of
        float-quantized checkpoints: a runtime's choice, not weights)."""
        return {}

    def weight_files(self) -> list[str]:
        """The files the model's tensors are read from, to name one in a refusal (relative to `path`)."""
        return []

    def write_gguf_tokenizer(self, writer) -> bool:
        """Copy its own `tokenizer.ggml.*` keys into a gguf.GGUFWriter and say so (a GGUF source: the tokenizer
        travels verbatim instead of being rebuilt from tokenizer files); False when it has none."""
        return False
