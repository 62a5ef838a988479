"""UQFF writer: a model directory that mistral.rs loads with `from_uqff="<stem>-0.uqff"`.

Written: `<stem>-0.uqff`, `<stem>-1.uqff`, ... (safetensors shards of at most 10 GiB, the version tensors
in the first), `residual.safetensors` (every tensor that is not a UQFF layer: norms, dense leftovers),
`config.json` without any `quantization_config` (mistral.rs would build GPTQ layers from it) and with a
top-level `rope_theta` and `partial_rotary_factor` (mistral.rs' configs read them there), and the tokenizer
files. `<stem>` is the `--type` name, or the most common layer type. The version is the lowest 1.x that
covers the file: 1.0, 1.1 with inline Unquant layers, 1.2 with a quantized token embedding.

Per layer the target is `--tensor-type REGEX=TYPE`, else `--type`, else the cheapest aligned type for
the source grid: GGUF blocks keep their ggml type (bytes copied), GPTQ/HQQ-axis-1 grids go to Q4_0 /
Q8_0 blocks (GGUF rules) or AFQ (scale and bias per group: codes kept, float32 scales and biases), HQQ
axis-0 grids to UQFF HQQ (codes, scales, zeros kept). Types are mistral.rs' ISQ names (layout.UQFF_TYPES).

mistral.rs dequantizes AFQ in the dtype of the stored scales, so AFQ scales and biases are written in float32:
a GPTQ grid's fp16 scale times an integer code, and its bias -scale*zero, are exact there. Inline Unquant
layers (`--type f32/f16/bf16`) are multiplied in their stored dtype without a cast: pick mistral.rs' run dtype
(float32 on a CPU, its default there); layer biases are likewise used as stored and are written in float32.
Requantizing (only with --allow-requant) uses each family's rule: ggml's reference quantizers (kernels),
HQQ's (kernels.hqq, axis 0, 10 steps, as mistral.rs' ISQ), MLX's affine min/max, and mistral.rs' FP8 / F8Q8 /
MXFP4 scale rules; the bytes need not equal mistral.rs' own quantizer's, the decode does. Each layer is encoded
by the codec of its type's family (codecs/); this module plans the layers and writes the shards.

MoE models (moe.py): the per-expert records of a projection become one stacked `<block>.experts.<proj>` layer
`[E, out, in]` as mistral.rs writes it (Mixtral under its `block_sparse_moe` names, its router a layer like any
linear; Qwen3-MoE's router dense in the residual). Each expert is encoded as a 2-D layer (GPTQ codes kept where
they align) and its decoded values returned; its encoded tensors wait in the session until the stack's last
expert arrives, so one layer's experts are held at most. A stack has one type (GGUF blocks, AFQ or Unquant:
mistral.rs refuses stacked HQQ / FP8 / F8Q8).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from ... import __version__
from ...converters.checker import EXACT, REFUSED, REQUANTIZE, Decision, best_aligned, check, describe_grid
from ...converters.errors import QConvertError
from ...converters.plan import BitIdentical, Options, TensorPlan, Writer, WriterSession, unknown_type
from ...converters.records import Dense, Grid, TensorRecord
from ..common.block_schemes import block_layout
from ..common.checkpoint import copy_side_files, write_json
from ..common.ggml_codec import QuantHow
from ..common.quant_config import without_quantization_config
from ..common.rope_keys import with_top_level_rope
from ..common.safetensors_header import safetensors_tag
from .codecs import UqffAction, codec
from .layout import MAJOR, UQFF_TYPES, UqffType
from .moe import STACKABLE_FAMILIES, ExpertStacks, StackedTensor, expert_slot, mistralrs_moe_config, moe_model
from .schemes import REQUANT_DEFAULT, candidates_for_bits, scheme_for

__all__ = ["UqffWriter", "MAX_SHARD_BYTES", "parse_uqff_type"]

MAX_SHARD_BYTES = 10 * 1024**3  # mistral.rs' MAX_UQFF_SIZE_BYTES (a soft cap between tensors)
# modules mistral.rs asks the UQFF for (linears and the token embedding); everything else is residual
_LAYER = re.compile(r"(?:_proj|^lm_head|embed_tokens)\.weight$")
_LAYER_BIAS = re.compile(r"_proj\.bias$")
_EMBEDDING = re.compile(r"embed_tokens\.weight$")
_TYPE_OF_GGML = {t.ggml: t.name for t in UQFF_TYPES.values() if t.ggml}


def parse_uqff_type(text: str) -> UqffType:
    key = text.strip().lower().replace("-", "_")
    key = re.sub(r"^q(\d)_k$", r"q\1k", key)
    key = {"f8e4m3": "fp8", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(key, key)
    if key not in UQFF_TYPES:
        raise unknown_type(text, list(UQFF_TYPES), "UQFF")
    return UQFF_TYPES[key]


def _where(plan: TensorPlan) -> str | None:
    return plan.action.where if plan.action is not None else None


# -- the checker's verdict, in the facts the session needs ------------------------------------------------
def check_target(t: UqffType, rec: TensorRecord) -> tuple[Decision, dict]:
    """(decision, the UqffAction fields the session needs) for storing `rec` as UQFF type `t`
    (converters/checker.check)."""
    scheme, note = scheme_for(t, rec.shape[-1])
    d = check(rec.params if rec.params is not None else rec.dtype, rec.shape, scheme,
              native=rec.native_type, prefer_groups=rec.source_groups)
    facts: dict = {}
    if scheme.family == "ggml":
        if d.verdict == REFUSED and not d.copied:
            return d.with_reason(prefix=note), facts
        facts["ggml"] = block_layout(scheme).name
        if d.kept_blocks:  # Q4_K/Q5_K blocks that hold the grid keep its codes, as in the GGUF writer
            facts["quant"] = QuantHow(keep_codes=True)
    elif d.group_size is not None:
        facts["group_size"] = d.group_size
        if d.keeps_codes:
            facts["aligned"] = True
        if scheme.family == "hqq-axis0" and d.keeps_codes:
            facts.update(meta_dtype=d.meta_dtype, hqq_flags=dict(rec.layer_flags.get("uqff", {})))
    return d.with_reason(prefix=note), facts


def _best_aligned(rec: TensorRecord, stacked: bool = False) -> tuple[str, str] | None:
    """(type, verdict) of the cheapest type that holds the grid exactly, else near-exactly; for an expert of
    a stacked layer only among the families mistral.rs loads stacked."""
    names = [n for n in candidates_for_bits(rec.params.bits)
             if not stacked or UQFF_TYPES[n].family in STACKABLE_FAMILIES]
    schemes = [scheme_for(UQFF_TYPES[n], rec.shape[-1])[0] for n in names]
    best = best_aligned(rec.params, rec.shape, schemes, native=rec.native_type, prefer_groups=rec.source_groups)
    return (best[0].name, best[1].verdict) if best else None


class UqffWriter(Writer):
    name = "uqff"

    def plan_tensor(self, rec: TensorRecord, options: Options, source) -> TensorPlan:
        moe = moe_model(source.config or {})
        slot = expert_slot(rec.name, moe)
        out_name = moe.out_name(rec.name) if moe else rec.name
        explicit = options.explicit_type(rec.name)
        if rec.is_grid:
            return self._plan_layer(rec, explicit or options.type, slot, out_name)
        is_layer = len(rec.shape) == 2 and (_LAYER.search(rec.name) or (slot is not None and slot.part == "weight")
                                            or (moe is not None and moe.router_is_layer and moe.is_router(rec.name)))
        wanted = explicit or (options.type if not source.quant_config else None)
        if is_layer and wanted:
            return self._plan_layer(rec, wanted, slot, out_name)
        if rec.dtype not in ("float32", "float16", "bfloat16") and rec.dtype not in ("int32", "int64", "uint8"):
            return TensorPlan(rec.name, rec.shape, rec.dtype, "residual", REFUSED, f"dtype {rec.dtype} not supported")
        bias = bool(_LAYER_BIAS.search(rec.name))
        action = UqffAction("residual", bias_of=rec.name[: -len(".bias")] if bias else None)
        if slot is not None:  # a dense expert (its stack is checked whole in check_model)
            action.stack, action.expert, action.expert_part = slot.stack, slot.expert, slot.part
        return TensorPlan(rec.name, rec.shape, rec.dtype, rec.dtype, EXACT, "copied", out_name=out_name, action=action)

    def _plan_layer(self, rec: TensorRecord, wanted: str | None, slot=None, out_name: str | None = None) -> TensorPlan:
        p = rec.params
        src = describe_grid(p, rec.shape[1]) if p is not None else rec.dtype
        stacked = slot is not None
        if len(rec.shape) != 2:
            return TensorPlan(rec.name, rec.shape, src, "?", REFUSED, "UQFF layers are read from 2-D records here (one "
                              "record per expert)")
        if wanted:
            t = parse_uqff_type(wanted)
        elif rec.native_type in _TYPE_OF_GGML:
            t = UQFF_TYPES[_TYPE_OF_GGML[rec.native_type]]
        else:
            best = _best_aligned(rec, stacked)
            t = UQFF_TYPES[best[0] if best else REQUANT_DEFAULT.get(p.bits, "afq4")]
        v, facts = check_target(t, rec)
        action = UqffAction("uqff", type=t.name, **facts)
        target = f"{t.name}" + (f" ({action.ggml})" if action.ggml and action.ggml != t.ggml else "")
        plan = TensorPlan(rec.name, rec.shape, src, target, v.verdict, v.reason, out_name=out_name or rec.name,
                          action=action)
        if stacked:
            plan.out_name = f"{slot.stack}.weight"
            action.where, action.stack, action.expert = "uqff-expert", slot.stack, slot.expert
            if t.family not in STACKABLE_FAMILIES:
                # mistralrs-quant's UQFF reader: "does not support stacked expert gather" for HQQ / FP8 / F8Q8
                plan.verdict, plan.reason = REFUSED, (f"experts are stacked into one layer per projection, and "
                                                      f"mistral.rs loads stacks only as GGUF blocks, AFQ or "
                                                      f"unquantized, not {t.name}")
        if plan.verdict in (REQUANTIZE, REFUSED) and p is not None:
            best = _best_aligned(rec, stacked)
            if best:
                plan.alternative = self.alternative_hint(*best)
        return plan

    def check_model(self, source, plans: list[TensorPlan], options: Options) -> None:
        _check_stacks(plans, moe_model(source.config or {}), source.path)
        layers = {p.name[: -len(".weight")] for p in plans if _where(p) in ("uqff", "uqff-expert")}
        for p in plans:  # a layer's bias travels with it in the .uqff (its presence is the "has bias" flag)
            if p.action is not None and p.action.bias_of in layers:
                p.action.where = "uqff-bias"
        if not layers and plans:
            raise QConvertError("nothing to store as UQFF layers: the source has no quantized tensors; pass "
                                "--type (e.g. --type q4k)", path=source.path)
        if "tokenizer.json" not in source.side_files():
            raise QConvertError("mistral.rs needs tokenizer.json next to the model; the source has none",
                                path=source.path)

    def open_split(self, folder: Path, name: str, source, plans: list[TensorPlan], options: Options):
        return _open_split(self, folder, name, source, plans, options)

    def open_part(self, folder: Path, source, plans: list[TensorPlan], options: Options, layout):
        return _open_part(self, folder, source, plans, options, layout)

    def part_group(self, plan: TensorPlan):
        return _part_group(self, plan)

    def open(self, path: Path, source, plans: list[TensorPlan], options: Options) -> "UqffSession":
        max_bytes = int(options.extra.get("uqff_max_shard_bytes") or MAX_SHARD_BYTES)
        return UqffSession(Path(path), source, plans, max_bytes)


def _open_split(self, folder: Path, name: str, source, plans: list[TensorPlan], options: Options):
    from ..common.split_replay import ReplaySplitOutput
    from .moe import StackedTensor

    return ReplaySplitOutput(self, folder, name, source, plans, options, ("shards", "residual"),
                             stacked_type=StackedTensor)


def _open_part(self, folder: Path, source, plans: list[TensorPlan], options: Options, layout):
    from ..common.split_replay import open_recording_part

    return open_recording_part(self, folder, source, plans, options, layout)


def _part_group(self, plan: TensorPlan):
    """The experts of one stacked layer stay in one part: the session holds them until the last arrives."""
    action = plan.action
    return action.stack if action is not None and getattr(action, "where", None) == "uqff-expert" else None


def _check_stacks(plans: list[TensorPlan], moe, path) -> None:
    """Every stacked expert layer must be whole and uniform before a byte is written: experts 0..E-1 all
    stored as UQFF (none left dense), one type, one shape, one group size; and no expert biases (stacked
    [E, out] biases are not written here)."""
    stacks: dict[str, list[TensorPlan]] = {}
    for p in plans:
        if p.action is not None and p.action.stack:
            stacks.setdefault(p.action.stack, []).append(p)
    for key, members in stacks.items():
        weights = [p for p in members if p.action.expert_part == "weight"]
        stored = [p for p in weights if p.action.where == "uqff-expert"]
        if not stored:
            continue  # dense experts stay per-expert tensors in the residual (mistral.rs stacks them itself)
        if len(stored) != len(weights):
            dense = next(p for p in weights if p.action.where != "uqff-expert")
            raise QConvertError(f"an expert of {key} would stay dense while the others are stored as "
                                f"{stored[0].action.type}: mistral.rs loads the experts of a projection as one "
                                "stacked layer; give them all one --tensor-type", path=dense.source_file or path,
                                tensor=dense.name)
        biases = [p for p in members if p.action.expert_part == "bias"]
        if biases:
            raise QConvertError("expert biases are not supported in stacked UQFF expert layers here",
                                path=biases[0].source_file or path, tensor=biases[0].name)
        experts = sorted(p.action.expert for p in stored)
        n = moe.num_experts if moe is not None and moe.num_experts else len(experts)
        if experts != list(range(n)):
            missing = sorted(set(range(n)) - set(experts))
            raise QConvertError(f"{key} needs experts 0..{n - 1} (config.json: {n} experts); "
                                f"{'missing ' + str(missing[:4]) if missing else 'found ' + str(experts[-1])}",
                                path=stored[0].source_file or path, tensor=stored[0].name)
        facts = {(p.action.type, p.action.ggml, p.action.group_size, tuple(p.shape)) for p in stored}
        if len(facts) > 1:
            shown = ", ".join(sorted({f"{t} {list(s)}" for t, _, _, s in facts}))
            raise QConvertError(f"the experts of {key} would be stored differently ({shown}); a stacked layer has "
                                "one type and shape: pass --type (or one --tensor-type for the experts)",
                                path=stored[0].source_file or path, tensor=stored[0].name)


def uqff_minor(plans: list[TensorPlan]) -> int:
    """The lowest 1.x minor that covers the layers: 1.2 stores token embeddings as layers, 1.1 Unquant."""
    layers = [p for p in plans if _where(p) in ("uqff", "uqff-expert")]
    if any(_EMBEDDING.search(p.name) for p in layers):
        return 2
    if any(UQFF_TYPES[p.action.type].family == "unquant" for p in layers):
        return 1
    return 0


class _SafetensorsStream:
    """A safetensors file written as tensors arrive: data goes to a side file, the header (which must come
    first) is written at close, then the data is copied behind it. Nothing is held in memory."""

    def __init__(self, path: Path, metadata: dict):
        self.path, self.metadata = Path(path), metadata
        self.data_path = self.path.with_name(self.path.name + ".data")
        self.data = open(self.data_path, "wb")
        self.header: dict = {}
        self.offset = 0

    def put(self, name: str, tensor: torch.Tensor | StackedTensor) -> None:
        if name in self.header:
            raise ValueError(f"duplicate tensor {name}")
        if isinstance(tensor, StackedTensor):  # stacked experts: the parts' bytes back to back
            dtype, shape, size = tensor.dtype, tensor.shape, 0
            for raw in tensor.raw_parts():
                self.data.write(raw)
                size += len(raw)
        else:
            t = tensor.detach().contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            self.data.write(raw)
            dtype, shape, size = t.dtype, tuple(t.shape), len(raw)
        tag = safetensors_tag(dtype)
        if tag is None:
            raise ValueError(f"{name}: no safetensors dtype for {dtype}")
        self.header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [self.offset, self.offset + size]}
        self.offset += size

    def close(self) -> None:
        self.data.close()
        header = {"__metadata__": self.metadata, **self.header}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * ((-len(blob)) % 8)
        with open(self.path, "wb") as f, open(self.data_path, "rb") as d:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            shutil.copyfileobj(d, f, 1 << 24)
        os.unlink(self.data_path)


class _ShardSet:
    """`<stem>-N.uqff` shards, a new one whenever the next tensor would pass the cap (version tensors first)."""

    def __init__(self, directory: Path, stem: str, max_bytes: int, minor: int):
        self.directory, self.stem, self.max_bytes = directory, stem, max_bytes
        self.version = f"{MAJOR}.{minor}.0"
        self.metadata = {"uqff.producer": "qconvert", "uqff.version": self.version,
                         "uqff.producer.qconvert.version": __version__}
        self.shards: list[_SafetensorsStream] = []
        self._new_shard()
        for part, value in zip(("major", "minor", "patch"), (MAJOR, minor, 0)):
            self.current.put(f"uqff.version.{part}", torch.tensor(value, dtype=torch.uint32))

    def _new_shard(self) -> None:
        if self.shards:
            self.shards[-1].close()
        self.current = _SafetensorsStream(self.directory / f"{self.stem}-{len(self.shards)}.uqff", self.metadata)
        self.shards.append(self.current)

    def put_layer(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.nbytes if isinstance(t, StackedTensor) else t.numel() * t.element_size()
                   for t in tensors.values())
        if self.current.offset and self.current.offset + size > self.max_bytes:
            self._new_shard()
        for name, t in tensors.items():
            self.current.put(name, t)

    def close(self) -> list[str]:
        self.shards[-1].close()
        return [s.path.name for s in self.shards]


class UqffSession(WriterSession):
    def __init__(self, path: Path, source, plans: list[TensorPlan], max_bytes: int):
        self.path, self.source = path, source
        counts: dict[str, int] = {}
        stacks: dict[str, tuple[int, str]] = {}
        for p in plans:
            if _where(p) in ("uqff", "uqff-expert"):
                counts[p.action.type] = counts.get(p.action.type, 0) + 1
            if _where(p) == "uqff-expert":
                n = stacks.get(p.action.stack, (0, ""))[0]
                stacks[p.action.stack] = (n + 1, UQFF_TYPES[p.action.type].family)
        self.stacks = ExpertStacks(stacks)  # check_model made each stack whole: experts 0..n-1, one type
        self.stem = max(counts, key=counts.get) if counts else "model"
        minor = uqff_minor(plans)
        self.shards = _ShardSet(path, self.stem, max_bytes, minor)
        self.residual = _SafetensorsStream(path / "residual.safetensors", dict(self.shards.metadata))

    # -- one tensor ---------------------------------------------------------------------------------------
    def add(self, plan: TensorPlan, item: Dense | Grid) -> torch.Tensor | BitIdentical:
        action: UqffAction = plan.action
        where = action.where
        if where == "residual":
            self.residual.put(plan.out_name, item.tensor)
            return item.tensor.to(torch.float32)
        if where == "uqff-bias":
            # mistral.rs adds a layer's bias as stored, without a cast (an fp16 bias in its default CPU
            # float32 run fails "dtype mismatch in add"); float32 is what its ISQ writes for GGUF layers
            bias = item.tensor.to(torch.float32) if item.tensor.is_floating_point() else item.tensor
            self.shards.put_layer({plan.out_name: bias})
            return bias
        t = UQFF_TYPES[action.type]
        tensors, decoded = codec(t.family).encode(t, plan, item)
        if where == "uqff-expert":
            # one expert of a stacked layer: held encoded until the stack's last expert arrives
            key = action.stack
            tensors = self.stacks.add(key, action.expert, tensors)
            if tensors is None:
                return decoded
        else:
            key = plan.out_name[: -len(".weight")]
        self.shards.put_layer({(f"{key}.{k}" if k else f"{key}.weight"): v for k, v in tensors.items()})
        return decoded

    def close(self) -> None:
        if self.stacks.unfinished():
            raise QConvertError(f"internal error: stacked expert layers left incomplete: {self.stacks.unfinished()[:3]}")
        self.shards.close()
        self.residual.close()
        config = mistralrs_moe_config(without_quantization_config(dict(self.source.config)))
        # mistral.rs' configs read rope_theta at the top level (Llama and every other), and GLM-4.5's
        # (GLM4Moe) also partial_rotary_factor, a required field there ("missing field
        # `partial_rotary_factor`" without it); transformers 5 writes both inside rope_parameters
        config = with_top_level_rope(config, ("rope_theta", "partial_rotary_factor"))
        write_json(self.path / "config.json", config)
        copy_side_files(self.source, self.path)
