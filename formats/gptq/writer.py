"""Writing GPTQ checkpoints in the v1 or v2 zero convention, loadable by gptqmodel and transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ... import __version__
from ...converters.checker import EXACT, REFUSED, REQUANTIZE, Decision, check, check_grid_to_float
from ...converters.errors import QConvertError
from ...converters.plan import Options, TensorPlan, Writer, WriterSession
from ...converters.records import Dense, Grid, GridParams, NativeForm, TensorRecord, describe_record
from ...kernels.bitpack import SUPPORTED_PACK_BITS, pack_rows
from ...kernels.hadamard import fold_online_hadamard
from ..common.checkpoint import ShardWriter, copy_side_files, write_json
from .layout import encode_zeros
from .schemes import GPTQ_SCHEMES, ModuleScheme, parse_gptq_type


_DENSE_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
_EMBEDDING = re.compile(r"(^|\.)embed_tokens\.weight$")


@dataclass(frozen=True)
class GptqAction:
    """What the session does with one tensor, beyond storing the source's grid or dense tensor as it is."""

    dense: torch.dtype | None = None  # a quantized embedding or head, stored dequantized in this dtype
    scheme: ModuleScheme | None = None  # requantized with round-to-nearest at this scheme
    grid_view: Callable[[], Grid] | None = None  # store the source's own 4-bit grid instead (NativeForm "4bit-grid")
    rotated_grid: Callable[[], Grid] | None = None  # store the rotated grid behind a folded stand-in
    rotation: str | None = None  # ... and keep gptqmodel's `rotation` key


class GptqWriter(Writer):
    """Writes a GPTQ checkpoint directory in the v1 or v2 zero convention, loadable by gptqmodel."""

    def __init__(self, convention: str):
        self.convention = convention
        self.name = "gptq-v2" if convention == "v2" else "gptq"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        rotated = rec.native_form("rotated-grid")
        if rotated is not None:
            return self._plan_rotated(rec, rotated, options, source)
        explicit = options.explicit_type(rec.name) or options.type
        if rec.is_grid:
            p = rec.params
            # GPTQ quantizes the decoder blocks' linears only: a quantized embedding (GGUF token_embd) or
            # output head is stored dequantized in fp16, as GPTQ models keep them. A quantized head would
            # load in gptqmodel (`lm_head: true`) but not in transformers: its GPTQ loader (optimum)
            # replaces the linears inside the blocks only, all with one bits/group_size, and leaves a
            # quantized head's weight uninitialized (random logits)
            if _EMBEDDING.search(rec.name) or rec.name == "lm_head.weight":
                return self.plan(rec, check_grid_to_float(p, "F16"), "float16",
                                 reason_prefix="kept unquantized as in GPTQ models: ",
                                 action=GptqAction(dense=torch.float16))
            if explicit:
                want = parse_gptq_type(explicit)
                same = (want.bits == p.bits and (want.group_size if want.group_size > 0 else rec.shape[1]) == p.group_size
                        and (want.sym == p.symmetric or not want.sym))
                if not want.sym and self.convention == "v1":
                    return self._asym_v1_refusal(rec, explicit)
                if not same:
                    view = rec.native_form("4bit-grid")  # a source's own 4-bit form of the tensor (QQQ grouped)
                    keep = view is not None and want.bits == 4 and want.sym and want.group_size == view.facts["group_size"]
                    action = GptqAction(scheme=want, grid_view=view.load if keep else None)
                    return TensorPlan(rec.name, rec.shape, describe_record(rec), explicit, REQUANTIZE,
                                      "type differs from the source grid"
                                      + ("; the source's own 4-bit codes are kept" if keep else ""),
                                      alternative=self._aligned_type(p, rec.shape), out_name=rec.name, action=action)
            v = self._check_grid(p, rec.shape)
            target = f"gptq {p.bits}-bit g{p.group_size}" if p.n_groups > 1 else f"gptq {p.bits}-bit per-channel"
            if v.verdict == REFUSED and self.convention == "v1" and not p.symmetric and p.integer_zeros:
                return TensorPlan(rec.name, rec.shape, describe_record(rec), target, REFUSED, v.reason,
                                  alternative="gptq-v2 output (exact): qconvert 'SRC->gptq-v2'", out_name=rec.name)
            action = None
            if v.verdict == REQUANTIZE:
                # v1 output is written symmetric: gptqmodel loads asymmetric v1 only from its own files
                action = GptqAction(scheme=ModuleScheme(p.bits if p.bits in SUPPORTED_PACK_BITS else 4,
                                                        p.group_size if p.n_groups > 1 else -1,
                                                        self.convention == "v1", False))
            return self.plan(rec, v, target, action=action)
        if explicit and len(rec.shape) == 2 and _DENSE_LINEAR.match(rec.name):
            want = parse_gptq_type(explicit)
            if not want.sym and self.convention == "v1":
                return self._asym_v1_refusal(rec, explicit)
            return TensorPlan(rec.name, rec.shape, rec.dtype, explicit, REQUANTIZE,
                              "dense weights quantized with round-to-nearest (no calibration)",
                              out_name=rec.name, action=GptqAction(scheme=want))
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=rec.name)

    def _plan_rotated(self, rec: TensorRecord, rotated: NativeForm, options: Options, source) -> TensorPlan:
        """A rotated down_proj: GPTQ carries the rotation itself, so the stored (rotated) grid is planned as
        any grid and the `rotation` key goes into the output config; gptqmodel re-applies the transform."""
        rotation = rotated.facts["rotation"]
        grid_rec = TensorRecord(rec.name, rec.shape, "grid", rotated.load, params=rotated.facts["params"])
        plan = self.plan_tensor(grid_rec, options, source)
        plan.source = f"{plan.source} rotated ({rotation})"
        plan.target = f"{plan.target} + online Hadamard (rotation kept)"
        plan.keeps_source_form = True
        plan.action = replace(plan.action or GptqAction(), rotated_grid=rotated.load, rotation=rotation)
        return plan

    def _asym_v1_refusal(self, rec: TensorRecord, explicit: str) -> TensorPlan:
        return TensorPlan(rec.name, rec.shape, describe_record(rec), explicit, REFUSED,
                          "asymmetric GPTQ is written as v2: gptqmodel loads asymmetric v1 only from its own files",
                          alternative=f"gptq-v2 output: qconvert 'SRC->gptq-v2' --type {explicit}", out_name=rec.name)

    def _aligned_type(self, p: GridParams, shape: tuple[int, ...]) -> str:
        """The advice when `--type` asks for another grid than the source's: without `--type` every tensor
        keeps its own grid, which is exact when GPTQ holds it (one `--type` may not fit every tensor: a
        g128 checkpoint's 128-wide rows are single groups); "" when it does not hold it."""
        return "no --type (every tensor keeps its own grid: exact)" if self._check_grid(p, shape).verdict == EXACT else ""

    def _check_grid(self, p: GridParams, shape: tuple[int, ...]) -> Decision:
        return check(p, shape, GPTQ_SCHEMES[self.convention])

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "GptqSession":
        return GptqSession(self, Path(path), source, plans)


    def open_split(self, folder: Path, name: str, source, plans: list[TensorPlan], options: Options):
        from ..common.split_replay import ReplaySplitOutput

        return ReplaySplitOutput(self, folder, name, source, plans, options, ("shards",), merge_state=_merge_state)

    def open_part(self, folder: Path, source, plans: list[TensorPlan], options: Options, layout):
        from ..common.split_replay import open_recording_part

        return open_recording_part(self, folder, source, plans, options, layout,
                                   state_of=lambda s: (s.schemes, s.dense_linears, s.rotation))


def _merge_state(session: "GptqSession", state) -> None:
    """A part's schemes, dense linears and rotation, into the driver's session (in part order: the order a
    single process would have met them)."""
    schemes, dense, rotation = state
    session.schemes.update(schemes)
    session.dense_linears.extend(dense)
    session.rotation = session.rotation or rotation


class GptqSession(WriterSession):
    """Streams GPTQ tensors into safetensors shards; writes config and side files at the end."""

    def __init__(self, writer: GptqWriter, path: Path, source, plans: list[TensorPlan]):
        self.writer, self.path, self.source = writer, path, source
        self.shards = ShardWriter(path)
        self.schemes: dict[str, ModuleScheme] = {}
        self.dense_linears: list[str] = []
        self.rotation: str | None = None

    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor:
        action: GptqAction = plan.action or GptqAction()
        if action.rotated_grid is not None:
            # `item` is the folded stand-in; store the rotated grid and keep the rotation in the config.
            # What gptqmodel computes from it is the grid with the transform folded: return that to measure.
            item, self.rotation = action.rotated_grid(), action.rotation
        if action.dense is not None:
            item = Dense(item.dequantize(action.dense))
        elif action.grid_view is not None:
            item = action.grid_view()
        elif plan.verdict == REQUANTIZE:
            scheme = action.scheme
            w = item.dequantize(torch.float32)
            item = Grid.rtn(w, scheme.bits, scheme.group_size, scheme.sym)
        if isinstance(item, Grid):
            prefix = plan.name[: -len(".weight")] if plan.name.endswith(".weight") else plan.name
            self._add_grid(prefix, item)
            decoded = item.dequantize(torch.float32)
            return fold_online_hadamard(decoded) if action.rotated_grid is not None else decoded
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
            raise QConvertError("nothing to write as GPTQ: the source has no quantized tensors (pass --type, e.g. 4g128)",
                                path=self.source.path)
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
              "lm_head": False, "method": "gptq", "quant_method": "gptq",
              "format": fmt, "checkpoint_format": fmt, "pack_dtype": "int32"}
        if fmt == "gptq_v2":
            # gptqmodel's `meta` marks its own files; auto-round's loader in transformers refuses files that
            # carry it (they may be v2), and v1 files load the same in gptqmodel without it
            qc["meta"] = {"quantizer": [f"qconvert:{__version__}"]}
        if dynamic:
            qc["dynamic"] = dynamic
        if self.rotation:
            qc["rotation"] = self.rotation
        return qc
