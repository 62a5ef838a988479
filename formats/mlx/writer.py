"""Writing mlx-lm model folders: quantized linears as mlx affine grids, everything else as it is.

A grid keeps its codes when the mlx affine grid holds it (schemes.check_mlx decides, from the data):
scales are the source's, in the model dtype; the bias is the source's min, or -scale*zero computed in
float32 and rounded once to the model dtype; a source group wider than the mlx group (GPTQ g256, a
per-channel row) repeats its scale over the mlx groups inside it, and an act-order index whose scatter
stays inside mlx groups takes each group's scale from its index. Other grids, and dense weights given a
--type, are quantized with mlx's own affine rule (packing.mlx_affine_quantize = mx.quantize bit for bit).

What each tensor decodes to is returned as mlx computes it (fp(fp(s*q) + b) in the model dtype), so the
runner's measured error is the error mlx-lm sees. `--scale-dtype` stores scales and biases (and so mlx's decoding)
in another dtype than the model's: float32 makes a float16 grid with integer zeros that its source decodes in
float32 (GPTQ, compressed-tensors) exact, s*q + b being s*(q - z) unrounded there; the model's other tensors stay
as they are.

An E2M1 float grid whose scales are E8M0 exponents per 32 (any MXFP4 source: gpt-oss, Quark, compressed-tensors,
GGUF MXFP4, mlx's own mxfp4) is written in mlx's `mxfp4` mode instead, codes and exponents kept: `weight` uint32
of nibbles (LSB first), `scales` uint8, no biases, the module's quantization entry `mode: "mxfp4"`; an E4M3 one
(OCP MXFP8: compressed-tensors mxfp8-quantized, AMD Quark MXFP8, mlx's own) in mlx's `mxfp8` mode the same way,
four E4M3 bytes a uint32 word.

A MoE layer's routed experts are written stacked in mlx-lm's switch layers, as mlx_lm.convert writes them
(formats/mlx/experts.py): each expert's parts go to their slot of a temporary file per stacked tensor, stored once
the last expert arrived; check_model makes sure every expert of a stack is there with one mlx type.

config.json gets mlx-lm's `quantization` (the most common bits/group as the default, a per-module entry
for every other one, false for linears left dense) and its copy `quantization_config`, as mlx-lm's
save_config writes them; tokenizer and generation files are copied. Shards stream through ShardWriter
(model.safetensors, or model-0000i-of-0000n.safetensors with an index: mlx_lm.load globs model*.safetensors).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...converters.checker import EXACT, NEAR_EXACT, REFUSED, REQUANTIZE, decide
from ...converters.errors import BadInput, RefusedPlan
from ...converters.model_shapes import canonical_name
from ...converters.plan import Options, TensorPlan, Writer, WriterSession
from ...converters.records import Dense, Grid, TensorRecord, describe_record
from ...kernels.dequant import dequantize_grid_torch
from ...kernels.floatq import float_to_e8m0
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from .configs import to_mlx_lm
from .experts import StackSpill, layout_for
from .packing import mlx_affine_quantize, pack_mlx
from .schemes import MLX_FLOAT_MODES, bits_for, mlx_scheme, parse_mlx_type

__all__ = ["MlxWriter", "model_dtype"]

logger = logging.getLogger(__name__)

# the modules mlx-lm's nn.quantize turns into quantized ones (nn.Linear, nn.Embedding: `to_quantized`)
_QUANTIZABLE = re.compile(r"^(model\.layers\.\d+\..*_proj|model\.embed_tokens|lm_head)\.weight$")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def model_dtype(config: dict) -> torch.dtype:
    """The dtype scales and biases are stored in: config.json's torch_dtype / dtype (what mlx_lm.convert
    casts to), float16 when it names none."""
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
            return _DTYPES[value.replace("torch.", "")]
    return torch.float16


@dataclass(frozen=True)
class MlxAction:
    """A linear stored as an mlx affine grid: `bits` and `group`, from the source's codes (`keep`) or quantized
    with mlx's own rule. Tensors without an action are stored as they are (dequantized to the model dtype when
    the source holds a grid)."""

    bits: int
    group: int
    keep: bool
    mode: str = "affine"


@dataclass(frozen=True)
class MlxDrop:
    """A tensor not written: mlx-lm's model has no place for it (Qwen3-Next's MTP block, experts.Presanitized)."""

    drop: bool = True


class MlxWriter(Writer):
    """The registered writer; `for_conversion` gives the per-conversion one that knows the model dtype."""

    name = "mlx"

    def __init__(self, store: torch.dtype | None = None):
        self.store = store

    def for_conversion(self, source, options: Options) -> "MlxWriter":
        # --scale-dtype: scales and biases in another dtype than the model's. float32 keeps a float16 integer-zero
        # grid (GPTQ, compressed-tensors) exact: mlx decodes s*q + b in the scales' dtype, and in float32 that is
        # s*(q - z) with no rounding (schemes.check_mlx), where float16 rounds s*q and the sum (near-exact)
        chosen = options.extra.get("scale_dtype")
        return MlxWriter(_DTYPES[chosen] if chosen else model_dtype(source.config or {}))

    def alternative_hint(self, scheme: str, verdict: str) -> str:
        return f"no --type (the source grid as {scheme}: {verdict})"

    # -- planning ------------------------------------------------------------------------------------
    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        layout = layout_for(source.config)
        sanitized = layout.sanitized if layout is not None else None
        if sanitized is not None and sanitized.drops(rec.name):
            return TensorPlan(rec.name, rec.shape, describe_record(rec), "dropped", EXACT,
                              "dropped: mlx-lm does not run it (its sanitize drops it)", action=MlxDrop())
        plan = self._plan_tensor(rec, options, source)
        slot = _stacked_slot(layout, plan.name, source.config)
        if slot is not None:  # an expert: written into its layer's switch layer (experts.py)
            plan.out_name = f"{slot[0]}[{slot[1]}]"
        if sanitized is not None and plan.action is None and len(rec.shape) == 1 and \
                rec.name.endswith(sanitized.shifted_norms):
            plan.verdict = NEAR_EXACT  # the runner measures it: exact when 1 + w rounds to nothing
            plan.reason = "stored as 1 + w, mlx-lm's form of this norm (its sanitize adds 1 only to per-expert folders)"
        return plan

    def check_model(self, source, plans: list[TensorPlan], options: Options) -> None:
        """The experts of every switch layer are all there, one shape and one mlx type: mlx-lm's
        QuantizedSwitchLinear has one bits and group size for all of them."""
        layout = layout_for(source.config)
        if layout is None:
            return
        stacks: dict[str, dict[int, TensorPlan]] = {}
        for p in plans:
            slot = _stacked_slot(layout, p.name, source.config) if not isinstance(p.action, MlxDrop) else None
            if slot is not None:
                stacks.setdefault(slot[0], {})[slot[1]] = p
        count = layout.expert_count(source.config)
        folder = Path(getattr(source, "path", "."))
        where = folder / "config.json" if folder.is_dir() else folder
        for name, members in stacks.items():
            if count is None:
                raise BadInput(f"the checkpoint has expert tensors ({name}) but config.json's {layout.count_key} "
                               "is not a positive integer", path=where)
            missing = sorted(set(range(count)) - set(members))
            if missing or len(members) != count:
                raise BadInput(f"{name}: experts {missing[:4] or sorted(set(members) - set(range(count)))[:4]} do not "
                               f"match config.json's {layout.count_key} = {count}; mlx-lm stacks all of them",
                               path=where, tensor=layout.expert_name(name, (missing or [0])[0]))
            forms = {(p.shape, _stack_form(p.action)) for p in members.values()}
            if len(forms) > 1:
                first, other = sorted(forms, key=str)[:2]
                raise RefusedPlan(f"{name}: its experts are not one mlx type ({_describe(first)} and "
                                  f"{_describe(other)}), which mlx-lm's switch layer needs; give them one --type")

    def _plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        store = self.store or model_dtype(source.config or {})
        explicit = options.explicit_type(rec.name) or options.type
        want = parse_mlx_type(explicit) if explicit else None
        if rec.is_grid and want is None and rec.params.element in MLX_FLOAT_MODES:
            mode, scheme = MLX_FLOAT_MODES[rec.params.element]
            d = decide(rec.params, rec.shape, scheme)
            if d.verdict == EXACT and d.keeps_codes:
                return self.plan(rec, d, f"mlx {mode} g32", action=MlxAction(scheme.bits, 32, True, mode))
        if rec.is_grid:
            p = rec.params
            bits = want.bits if want else (bits_for(p.bits) or 8)
            scheme = mlx_scheme(bits, want.group if want else 0, store)
            auto = mlx_scheme(bits_for(p.bits) or 8, 0, store)
            d = decide(p, rec.shape, scheme, [auto] if want else [], prefer_groups=rec.source_groups)
            return self._plan(rec, d, bits)
        if want is not None and len(rec.shape) == 2 and _QUANTIZABLE.match(_mlx_name(rec.name, source)):
            d = decide(rec.dtype, rec.shape, mlx_scheme(want.bits, want.group, store))
            if d.verdict != REFUSED:
                return self._plan(rec, d, want.bits)
            # mlx_lm.convert leaves a layer whose rows are not whole groups unquantized (quantize_model's
            # predicate), and mlx-lm loads it as a plain layer: so does this writer
            return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, f"kept unquantized: {d.reason}",
                              out_name=rec.name)
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)

    def _plan(self, rec: TensorRecord, d, bits: int) -> TensorPlan:
        target = f"mlx {bits}-bit g{d.group_size}" if d.group_size else f"mlx {bits}-bit"
        plan = self.plan(rec, d, target,
                         action=None if d.verdict == REFUSED else MlxAction(bits, d.group_size, d.keeps_codes))
        if not d.alternative and d.verdict == REQUANTIZE and rec.is_grid and \
                not rec.params.contiguous_groups(rec.shape[-1]):
            plan.alternative = "gptq-v2 or gguf output, which keep an act-order grid"
        return plan

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "MlxSession":
        return MlxSession(Path(path), source, self.store or model_dtype(source.config or {}))


def _mlx_name(name: str, source) -> str:
    """The name mlx-lm's model gives a tensor: an expert's is its switch layer's (Mixtral's `experts.E.w1` is
    `switch_mlp.gate_proj`, a linear mlx-lm quantizes)."""
    slot = _stacked_slot(layout_for(source.config), name, source.config)
    return name if slot is None else slot[0]


def _stacked_slot(layout, name: str, config: dict | None) -> tuple[str, int] | None:
    """An expert tensor's switch-layer name and index, found under the name the release gives it: a producer's
    own per-expert names (llm-compressor's MiniMax-M2 `experts.E.gate_proj`) are renamed as every writer renames
    them first (converters.model_shapes, `canonical_name`)."""
    return layout.stacked_slot(canonical_name(name, config or {})) if layout is not None else None


def _stack_form(action: MlxAction | None) -> tuple:
    return ("dense",) if action is None else (action.bits, action.group, action.mode)


def _describe(form: tuple) -> str:
    shape, kind = form
    return f"{list(shape)} " + ("unquantized" if kind == ("dense",) else f"{kind[0]}-bit g{kind[1]} {kind[2]}")


class MlxSession(WriterSession):
    max_shard_bytes = 2 * 1024**3  # ShardWriter's default (mlx_lm.convert's own shards are 5 GB at most)

    def __init__(self, path: Path, source, store: torch.dtype):
        self.path, self.source, self.store = path, source, store
        self.shards = ShardWriter(path, max_shard_bytes=self.max_shard_bytes)
        self.schemes: dict[str, tuple[int, int, str]] = {}  # module path -> (bits, group, mode)
        self.dense_linears: dict[str, None] = {}  # module paths, in order (a switch layer once)
        self.layout = layout_for(source.config)
        self.count = self.layout.expert_count(source.config) if self.layout is not None else None
        self.pending: dict[str, StackSpill] = {}  # switch layer tensors being filled, by output name
        self.warned = False  # the ignored routing tensor warned about (once a conversion)

    def _put(self, name: str, tensor: torch.Tensor, slot: tuple[str, int] | None) -> None:
        """Store a tensor; an expert's part goes to its slot of the stacked tensor `slot[0]`'s spill, which is
        stored once its last expert arrived."""
        if slot is None:
            self.shards.put(name, tensor)
            return
        if name not in self.pending:
            self.pending[name] = StackSpill(self.path, self.count, tensor)
        spill = self.pending[name]
        spill.put(slot[1], tensor)
        if spill.complete:
            del self.pending[name]
            self.shards.put(name, spill.stacked())

    def _warn_ignored(self, name: str, tensor: torch.Tensor) -> None:
        ignored = self.layout.ignored_routing if self.layout is not None else None
        if ignored and not self.warned and name.endswith(ignored) and bool((tensor != 0).any()):
            self.warned = True
            logger.warning("%s is not zero: mlx-lm 0.32 drops %s and routes by the gate alone, so its model picks "
                           "other experts than transformers'", name, ignored)

    def _module(self, plan: TensorPlan) -> tuple[str, tuple[str, int] | None]:
        """The module path the tensor is written under (an expert's switch layer) and the expert slot, if any."""
        slot = _stacked_slot(self.layout, plan.name, self.source.config)
        name = slot[0] if slot is not None else plan.name
        return name[: -len(".weight")] if name.endswith(".weight") else name, slot

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        action: MlxAction | None = plan.action
        if isinstance(action, MlxDrop):
            return item.dequantize(torch.float32)
        prefix, slot = self._module(plan)
        if action is None:
            if _QUANTIZABLE.match(f"{prefix}.weight") and len(plan.shape) == 2:
                self.dense_linears[prefix] = None
            tensor = item.tensor if isinstance(item, Dense) else item.dequantize(self.store)
            name = f"{prefix}.weight" if slot is not None else plan.name
            self._warn_ignored(plan.name, tensor)
            sanitized = self.layout.sanitized if self.layout is not None else None
            if sanitized is not None:  # stored as mlx-lm's sanitize leaves it; measured as it reads back
                stored = sanitized.to_mlx(plan.name, tensor)
                self._put(name, stored, slot)
                return sanitized.from_mlx(plan.name, stored).to(torch.float32)
            self._put(name, tensor, slot)
            return tensor.to(torch.float32)
        bits, group = action.bits, action.group
        if action.mode != "affine":
            return self._add_float_mode(prefix, item, action, slot)
        if action.keep:
            codes, scales, biases = self._kept(item, group)
        else:
            codes, scales, biases = mlx_affine_quantize(item.dequantize(torch.float32), bits, group, self.store)
        self._put(f"{prefix}.weight", self._words(item, codes, bits, action.keep), slot)
        self._put(f"{prefix}.scales", scales.contiguous(), slot)
        self._put(f"{prefix}.biases", biases.contiguous(), slot)
        self.schemes[prefix] = (bits, group, "affine")
        # what mlx computes: scales * q, rounded to the stored dtype, plus biases, rounded again
        return dequantize_grid_torch(codes, scales, torch.zeros_like(scales), group, None, torch.float32,
                                     mins=biases, compute_dtype=self.store)

    def _add_float_mode(self, prefix: str, grid: Grid, action: MlxAction, slot) -> torch.Tensor:
        """mlx's mxfp4 / mxfp8 mode: the E2M1 / E4M3 codes and one E8M0 exponent per 32 (the checker made sure
        every scale is a power of two held exactly); what mlx decodes is code value times 2**(e - 127), exact in
        float32 (mx.dequantize(..., dtype=float32))."""
        p = grid.params
        out_f, in_f = grid.shape
        e8m0 = float_to_e8m0(p.folded_scales()[:, torch.arange(0, in_f, 32) // p.group_size]).contiguous()
        self._put(f"{prefix}.weight", pack_mlx(grid.codes, action.bits), slot)
        self._put(f"{prefix}.scales", e8m0, slot)
        self.schemes[prefix] = (action.bits, 32, action.mode)
        e = e8m0.view(torch.float8_e8m0fnu).to(torch.float32)
        return (p.codebook[grid.codes.to(torch.int64)].view(out_f, -1, 32) * e[..., None]).view(out_f, in_f)

    def _kept(self, grid: Grid, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The source's codes with one scale and bias per mlx group: the scale of the source group that
        holds the mlx group's first column (the checker made sure every column of it is in that group)."""
        p = grid.params
        in_features = grid.shape[1]
        first_cols = torch.arange(0, in_features, group)
        src_group = p.group_of_column(in_features)[first_cols]
        s = p.scales.to(torch.float32)[:, src_group]
        if p.mins is not None:
            b = p.mins.to(torch.float32)[:, src_group]
        else:
            b = -(s * p.zeros.to(torch.float32)[:, src_group])
        return grid.codes, s.to(self.store), b.to(self.store)

    @staticmethod
    def _words(grid, codes: torch.Tensor, bits: int, kept: bool) -> torch.Tensor:
        packed = getattr(grid, "packed", None) if kept else None
        if packed is not None and packed.layout == "gptq-rows" and packed.bits == bits and bits in (2, 4, 8):
            # GPTQ's int32 words run along the inputs LSB first: transposed, they are mlx's rows as they are
            return packed.words.T.contiguous().view(torch.uint32)
        return pack_mlx(codes, bits)

    def close(self) -> None:
        if self.pending:  # check_model made sure every expert is planned; a source that changed under us is a bug
            for spill in self.pending.values():
                spill.close()
            raise AssertionError(f"experts never arrived for {sorted(self.pending)}")
        self.shards.close()
        config = to_mlx_lm(dict(self.source.config))  # the keys mlx-lm requires (configs.py)
        for key in ("quantization", "quantization_config"):
            config.pop(key, None)
        if self.schemes:
            q = self._quantization()
            config["quantization"] = q
            config["quantization_config"] = q  # mlx-lm's save_config writes the same dict under both keys
        write_json(self.path / "config.json", config)
        copy_side_files(self.source, self.path)

    def _quantization(self) -> dict:
        counts: dict[tuple[int, int, str], int] = {}
        for s in self.schemes.values():
            counts[s] = counts.get(s, 0) + 1
        bits, group, mode = max(counts, key=counts.get)
        q: dict = {"group_size": group, "bits": bits, "mode": mode}
        for prefix, (b, g, m) in self.schemes.items():
            if (b, g, m) != (bits, group, mode):
                q[prefix] = {"group_size": g, "bits": b, "mode": m}
        for prefix in self.dense_linears:
            q[prefix] = False
        return q
