"""The runner: open the source, plan every tensor once, check the plan, then convert one tensor at a time into
a temporary output (output.py), measuring every tensor's error against the source dequantization (report.py),
and rename the output into place only on success.

One pass per record: planning streams the writer's records once and keeps each with its plan; the write loop
takes those (record, plan) pairs in the same order. A record loads its codes only when written, and a record
whose reader can read its small parameters again (scales, zero points: `TensorRecord.params_loader`) drops them
once planned (`release_params`), so what is held between the two is the plan of every tensor (and the
parameters of readers that cannot re-read them), never the codes or a dequantized copy: a giant MoE layer's
E8M0 scales are not all held at once.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
from tqdm import tqdm

from .checker import EXACT, NEAR_EXACT, REQUANTIZE
from .class_tensors import compare as compare_with_class
from .errors import BadInput, QConvertError, RefusedPlan
from .model_shapes import Layout, known_layout
from .output import atomic_output
from .plan import BitIdentical, Options, TensorPlan, Writer, check_plan
from .records import ModelSource, TensorRecord
from .registry import get_format
from .report import NotFinite, Report, TensorResult, check_finite_copy, kernel_summary, measure
from .validate import ConfigView, check_side_files
from ..kernels import kernel_trace, resolve_device, use_device

__all__ = ["convert", "return_large_buffers", "open_source", "plan_conversion", "resolve_device_option", "device_scope",
           "check_required_tensors", "check_model_identity"]


def open_source(fmt: str, path: Path, options: Options | None = None) -> ModelSource:
    entry = get_format(fmt)
    if not entry.can_read:
        raise QConvertError(f"format {entry.name!r} cannot be read yet")
    return entry.open_reader(Path(path), **((options.extra if options else {}) or {}))


def plan_conversion(source: ModelSource, writer: Writer, options: Options,
                    progress: bool = True) -> list[tuple[TensorRecord, TensorPlan]]:
    """Every record the writer takes with its plan, in stream order (the one pass over the source), after the
    model-wide checks: the side files the output carries (first: they are small), the tensors every model
    needs, and the writer's own (check_model)."""
    check_model_identity(source)
    if writer.copies_side_files:
        check_side_files(source.side_files())
    # the reader's own names and shapes, before the writer adapts them (GGUF splits DeepSeek's kv_b_proj):
    # what transformers' class is asked about (check_required_tensors' `shapes`)
    read_shapes: dict[str, tuple[int, ...]] = {}
    read_dtypes: dict[str, str] = {}  # and the dtype each was read as ("grid" for a quantized one)

    def noted(records: Iterable[TensorRecord]) -> Iterator[TensorRecord]:
        for rec in records:
            read_shapes.setdefault(rec.name, tuple(rec.shape))
            read_dtypes.setdefault(rec.name, str(rec.dtype))
            yield rec

    records = writer.adapt_records(noted(finite_params(source.records(), source.path)), source)
    pairs = []
    for rec, plan in tqdm(writer.plan_records(records, options, source), desc="Checking", unit="tensor",
                          disable=not progress, leave=False):
        plan.source_file = plan.source_file or str(record_file(source.path, rec.source_file))
        pairs.append((rec, mark_standin(rec, plan)))
        rec.release_params()  # the plan holds what it needs; the write reads the parameters with the codes
    plans = [plan for _, plan in pairs]
    check_required_tensors(source, [rec.name for rec, _ in pairs], {rec.name: rec.source_file for rec, _ in pairs},
                           read_shapes, read_dtypes)
    writer.check_model(source, plans, options)
    return pairs


def record_file(source_path: Path | str | None, source_file: str) -> Path:
    """The file a record was read from (its `source_file`: absolute, or a shard name inside the source
    folder), else the source path itself, to name in a refusal."""
    path = Path(source_path or ".")
    if not source_file:
        return path
    f = Path(source_file)
    return f if f.is_absolute() else (path / f if path.is_dir() else path.with_name(f.name))


def finite_params(records: Iterable[TensorRecord], source_path) -> Iterator[TensorRecord]:
    """The records as they stream, each grid's small parameters (scales, zero points, mins, the global scale)
    checked finite first: a NaN or inf there makes every value it scales NaN or inf, which no target can hold
    and requantizing cannot repair, so the source is refused at the tensor (cheaply: the parameters are already
    read; the codes are not)."""
    for rec in records:
        p = rec.params
        if p is not None:
            parts = {"scales": p.scales, "zero points": p.zeros if torch.is_floating_point(p.zeros) else None,
                     "mins": p.mins, "global scale": p.global_scale,
                     "scales' first step": p.scale_steps[0] if p.scale_steps else None}
            for what, values in parts.items():
                if values is not None and torch.is_floating_point(values):
                    _refuse_not_finite(what, values, rec, source_path)
            del p, parts
            rec.release_params()  # read again where used: a writer listing every record first holds none
        yield rec


def _refuse_not_finite(what: str, values: torch.Tensor, rec: TensorRecord, source_path) -> None:
    if values.dtype == torch.float8_e8m0fnu and not bool((values.view(torch.uint8) == 0xFF).any()):
        return  # E8M0 has no inf and one NaN byte: a giant's exponents checked without a float32 copy
    values = values.to(torch.float32)  # the stored dtype may be float8 (E4M3, E8M0 block scales)
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    kind = "NaN" if bool(torch.isnan(values).any()) else "inf"
    at = ""
    if values.dim() == 2:  # [out, n_groups], as GridParams holds them
        row, group = (int(i) for i in bad.nonzero()[0])
        at = f" (output row {row}, group {group})"
    verb = "hold" if what.endswith("s") else "holds"
    raise BadInput(f"{what} {verb} {kind}{at}: the source's values are not finite, and no conversion can repair "
                   "them", path=record_file(source_path, rec.source_file), tensor=rec.name)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_LAYERS = 1 << 16  # the deepest released models have ~130 layers


def check_model_identity(source) -> None:
    """config.json's `architectures` (class names) and `model_type`, which writers and the class check read
    before any tensor is planned: anything but a list of strings and a string is refused naming the key (either
    may be absent)."""
    config = source.config
    if not isinstance(config, dict):
        return
    view = ConfigView(config, _config_file(Path(source.path or ".")))
    view.str_list("architectures", default=None)
    view.str("model_type", default=None)


def _config_file(path: Path) -> Path:
    """The file a config refusal names: the folder's config.json, else the source itself (a GGUF file)."""
    return path / "config.json" if path.is_dir() and (path / "config.json").exists() else path


def check_required_tensors(source, names: list[str], files: dict[str, str] | None = None,
                           shapes: dict[str, tuple[int, ...]] | None = None,
                           dtypes: dict[str, str] | None = None) -> None:
    """What every model needs whatever its format, checked on the records' (Hugging Face) names, which
    every reader yields alike (one `<module>.weight` per quantized linear): some tensors at all;
    `lm_head.weight` when config.json unties it from the embedding (transformers would otherwise start
    the head from random values); every decoder layer below num_hidden_layers (a layer may be stored in
    several shards, but none may be absent).

    For the architectures whose names are known (model_shapes.KNOWN_LAYOUTS: llama, mistral, qwen2,
    qwen3) also: no name the architecture does not have (a renamed or foreign tensor, a layer at or
    beyond num_hidden_layers), and every tensor of the model present, in every layer (the biases where
    config.json says the model has them). Other architectures get no per-layer rule of ours (MoE, hybrid
    and multi-token-prediction models hold different tensors in different layers; DeepSeek-V3 stores its
    MTP layer as model.layers.<num_hidden_layers>): the embedding, the final norm and complete expert
    groups (_check_any_architecture), and, given the reader's `shapes`, every tensor transformers' own
    class loads for the config, in its shape (_check_class_tensors, class_tensors.py).

    For every architecture: the embedding, the final norm and the routed experts (_check_any_architecture).

    `files` maps names to the records' source_file, to name the file in a refusal."""
    path = Path(source.path or ".")
    files = files or {}
    if not names:
        shards = source.weight_files()
        raise BadInput("the checkpoint holds no tensors", path=path / shards[0] if len(shards) == 1 else path)
    config = source.config
    if not isinstance(config, dict):
        return
    where = _config_file(path)
    view = ConfigView(config, where)
    present = set(names)

    def file_of(name: str) -> Path:
        return record_file(path, files.get(name, ""))

    every_file = {file_of(n) for n in names}
    one_file = next(iter(every_file)) if len(every_file) == 1 else path

    if view.bool("tie_word_embeddings", default=None) is False and "lm_head.weight" not in present:
        raise BadInput("config.json sets tie_word_embeddings false, but the checkpoint has no output head",
                       path=one_file, tensor="lm_head.weight")
    n_layers = view.int("num_hidden_layers", default=None, lo=1, hi=_MAX_LAYERS)
    if n_layers is None and "num_hidden_layers" in config:
        view.int("num_hidden_layers", lo=1, hi=_MAX_LAYERS)  # null: refused, naming the key
    layout = known_layout(config, where)
    if layout is not None:
        for name in names:
            if not layout.allows(name, n_layers):
                raise BadInput(_not_in_layout(name, layout, n_layers), path=file_of(name), tensor=name)
    layer_files: dict[int, Path] = {}
    for name in names:
        m = _LAYER_NAME.match(name)
        if m:
            layer_files.setdefault(int(m[1]), file_of(name))
    if n_layers is not None and (layer_files or "model.embed_tokens.weight" in present or layout is not None):
        missing = [i for i in range(n_layers) if i not in layer_files]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise BadInput(f"config.json says num_hidden_layers {n_layers}, but the checkpoint has no tensor of "
                           f"layer {missing[0]}{more}", path=one_file, tensor=f"model.layers.{missing[0]}")
    if layout is None:
        _check_any_architecture(names, present, config, where, file_of, one_file)
        if shapes:
            _check_expert_shapes(shapes, file_of)
            _check_class_tensors(config, shapes, layer_files, file_of, one_file, dtypes)
        return
    for name in layout.top_required:
        if name not in present:
            why = ("config.json sets tie_word_embeddings false, so " if name == "lm_head.weight" else "")
            raise BadInput(f"missing: {why}{layout.class_name} needs it (transformers would start it from random "
                           "values)", path=one_file, tensor=name)
    for i in sorted(layer_files):
        for suffix in layout.layer_required:
            name = f"model.layers.{i}.{suffix}"
            if name not in present:
                because = layout.required_because.get(suffix)
                why = f"config.json says {because}" if because else f"{layout.class_name} has it in every layer"
                raise BadInput(f"missing: {why} (transformers would start it from random values)",
                               path=layer_files[i], tensor=name)


# `<head>.experts.<e>.<tail>`: one routed expert's tensor (Mixtral's block_sparse_moe.experts.3.w1, Qwen-MoE's
# mlp.experts.3.gate_proj.weight, an MTP block's experts too); shared experts do not match
_EXPERT_NAME = re.compile(r"^(?P<head>.*\.experts)\.(?P<index>0|[1-9][0-9]*)\.(?P<tail>.+)$")
# config.json's count of routed experts per MoE layer, by family (Mixtral and transformers 5, older Qwen-MoE,
# DeepSeek / GLM / Kimi, ERNIE)
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _check_any_architecture(names: list[str], present: set[str], config: dict, where: Path, file_of,
                            one_file: Path) -> None:
    """What holds for every decoder checkpoint qconvert reads, whatever its architecture (the per-layer rules of
    KNOWN_LAYOUTS do not: MoE, hybrid and MTP layers differ): a model with `model.layers.N` has its embedding and
    final norm (every class llama.cpp and transformers share names them so), and every group of routed experts
    holds each expert index below the count config.json gives (or, without a count, 0..max with none missing),
    each expert with the same tensors as its siblings. Found by scripts/fuzz: a DeepSeek-V3 checkpoint without
    its embedding, a norm or one expert converted to `hf` with that tensor missing and exit 0."""
    if any(_LAYER_NAME.match(n) for n in names):
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            if name not in present:
                raise BadInput("missing: a decoder with model.layers has it (transformers would start it from "
                               "random values; llama.cpp refuses the model)", path=one_file, tensor=name)
    view = ConfigView(config, where)
    declared = None
    for key in _EXPERT_COUNT_KEYS:
        if isinstance(config.get(key), int) and not isinstance(config.get(key), bool):
            declared = view.int(key, lo=1, hi=1 << 20)
            break
    groups: dict[str, dict[int, set[str]]] = {}
    for name in names:
        m = _EXPERT_NAME.match(name)
        if m:
            groups.setdefault(m["head"], {}).setdefault(int(m["index"]), set()).add(m["tail"])
    for head, experts in groups.items():
        count = declared if declared is not None else max(experts) + 1
        missing = [e for e in range(count) if e not in experts]
        beyond = [e for e in experts if e >= count]
        if beyond:
            raise BadInput(f"expert {beyond[0]} is beyond the {count} routed experts config.json declares",
                           path=file_of(f"{head}.{beyond[0]}.{next(iter(experts[beyond[0]]))}"),
                           tensor=f"{head}.{beyond[0]}")
        if missing:
            some = next(iter(experts.values()))
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise BadInput(f"missing: expert {missing[0]} of {count}{more}", path=file_of(f"{head}.{min(experts)}."
                           f"{next(iter(some))}"), tensor=f"{head}.{missing[0]}")
        full = set().union(*experts.values())
        for e in sorted(experts):
            if experts[e] != full:
                gap = sorted(full - experts[e])[0]
                raise BadInput(f"missing: expert {e} lacks what its siblings hold", path=file_of(
                    f"{head}.{e}.{next(iter(experts[e]))}"), tensor=f"{head}.{e}.{gap}")


def _check_expert_shapes(shapes: dict[str, tuple[int, ...]], file_of) -> None:
    """Each routed expert's tensor in the shape its siblings hold it: the class check leaves experts out (transformers
    fuses them), and one expert transposed to the same size converted with exit 0 (scripts/fuzz seed 2029, a
    DeepSeek-V3 FP8 down_proj [128, 64] -> [64, 128])."""
    seen: dict[tuple[str, str], dict[tuple[int, ...], list[int]]] = {}
    for name, shape in shapes.items():
        m = _EXPERT_NAME.match(name)
        if m:
            seen.setdefault((m["head"], m["tail"]), {}).setdefault(tuple(shape), []).append(int(m["index"]))
    for (head, tail), by_shape in seen.items():
        if len(by_shape) > 1:
            common = max(by_shape, key=lambda s: len(by_shape[s]))
            odd_shape, odd = next((s, e) for s, e in by_shape.items() if s != common)
            name = f"{head}.{min(odd)}.{tail}"
            raise BadInput(f"shape {odd_shape} differs from the {common} its {len(by_shape[common])} sibling "
                           "expert(s) hold", path=file_of(name), tensor=name)


def _check_class_tensors(config: dict, shapes: dict[str, tuple[int, ...]], layer_files: dict[int, Path], file_of,
                         one_file: Path, dtypes: dict[str, str] | None = None) -> None:
    """Every tensor transformers' class for this config.json loads is present, in its shape (class_tensors.py
    says what is compared and why). Found by scripts/fuzz: a DeepSeek-V3 FP8 checkpoint missing one layer's
    q_a_layernorm or router, or with the router's bias reshaped [4] -> [1, 4], converted with exit 0."""
    found = compare_with_class(config, shapes, dtypes)
    if found is None:
        return
    name, why = found
    if name in shapes:
        path = file_of(name)
    else:
        m = _LAYER_NAME.match(name)
        path = layer_files.get(int(m[1]), one_file) if m else one_file
    raise BadInput(why, path=path, tensor=name)


def _not_in_layout(name: str, layout: Layout, n_layers: int | None) -> str:
    m = _LAYER_NAME.match(name)
    if m and n_layers is not None and int(m[1]) >= n_layers:
        return (f"layer {m[1]} is beyond config.json's num_hidden_layers {n_layers} ({layout.model_type} models "
                "have no extra layers)")
    return (f"not a tensor of {layout.class_name} (config.json's model_type {layout.model_type!r}): a renamed or "
            "foreign tensor")


def _not_finite_refusal(e: NotFinite, rec: TensorRecord, plan: TensorPlan) -> QConvertError:
    if e.in_source:
        return BadInput(f"the source's values hold {e.what}{e.where}: nothing can be converted from them",
                        path=plan.source_file or None, tensor=rec.name)
    return RefusedPlan(f"stored as {plan.target}, its values decode to {e.what}{e.where}: the target cannot hold "
                       "them", path=plan.source_file or None, tensor=rec.name)


def mark_standin(rec: TensorRecord, plan: TensorPlan) -> TensorPlan:
    """A source may yield a float stand-in for a quantized tensor whose own form the target cannot hold
    (a rotated GPTQ down_proj with its online transform folded in): `rec.lossy_standin` says why.
    Storing the stand-in loses the source's grid, so the plan is `requantize` whatever the target type,
    unless the writer kept the source's own form (`plan.keeps_source_form`)."""
    why = rec.lossy_standin
    if why and plan.verdict in (EXACT, NEAR_EXACT) and not plan.keeps_source_form:
        plan.verdict, plan.reason = REQUANTIZE, f"{why} (stored as: {plan.reason})" if plan.reason else why
    return plan


def resolve_device_option(device: str | torch.device | None) -> torch.device:
    """`--device` as a torch.device, found once (kernels.resolve_device): an absent device is a QConvertError
    (one line, exit 2) before anything is read or written."""
    if isinstance(device, torch.device):
        return device
    try:
        return resolve_device(device)
    except ValueError as e:
        raise QConvertError(str(e)) from None


def device_scope(device: str | torch.device | None):
    """`with device_scope(options.device):` the kernels run on that device (kernels.use_device)."""
    return use_device(resolve_device_option(device))


_LARGE_BUFFER_BYTES = 1 << 20
_allocator_set = False


def return_large_buffers() -> None:
    """Make glibc's malloc hand every buffer of 1 MiB or more back to the system when it is freed (mallopt
    M_MMAP_THRESHOLD, which also stops the threshold from moving). By default glibc raises that threshold to the
    size of each large block freed (up to 32 MiB), after which a tensor's temporaries come from the heap and stay
    there, fragmented: converting a giant MoE layer's 768 expert tensors one at a time grew the RSS by hundreds of
    MB of freed memory (measured: docs/benchmarks.md). With the threshold fixed, the peak is a few tensors' work.
    A no-op where the C library is not glibc."""
    global _allocator_set
    if _allocator_set:
        return
    _allocator_set = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, _LARGE_BUFFER_BYTES)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def convert(src_format: str, src_path: Path, dst_format: str, out_path: Path | None,
            options: Options, *, force: bool = False, dry_run: bool = False,
            progress: bool = True) -> Report:
    """Convert on `options.device` (tensors move there one at a time); see _convert."""
    return_large_buffers()
    with device_scope(options.device):
        return _convert(src_format, src_path, dst_format, out_path, options, force=force, dry_run=dry_run,
                        progress=progress)


def _convert(src_format: str, src_path: Path, dst_format: str, out_path: Path | None,
             options: Options, *, force: bool = False, dry_run: bool = False,
             progress: bool = True) -> Report:
    start = time.perf_counter()
    target = get_format(dst_format)
    if not target.can_write:
        raise QConvertError(f"format {target.name!r} cannot be written yet")
    if out_path is not None and not dry_run and Path(out_path).exists() and not force:
        raise QConvertError("output exists; pass --force to replace it", path=out_path)
    source = open_source(src_format, src_path, options)
    # a writer that decides something once per model (the GGUF architecture, the QQQ target group) gives a
    # fresh object holding it for this conversion: nothing is stored on the source or the shared writer
    writer = target.writer.for_conversion(source, options)
    pairs = plan_conversion(source, writer, options, progress)
    plans = [plan for _, plan in pairs]
    report = Report(source.format_name, target.name, str(src_path), None if dry_run else str(out_path),
                    dry_run=dry_run, ignored_files=dict(source.ignored_files), not_carried=dict(source.not_carried))
    if dry_run:
        report.results = [TensorResult(p) for p in plans]
        report.seconds = time.perf_counter() - start
        return report
    check_plan(plans, options.allow_requant)

    with atomic_output(Path(out_path), writer.output_is_file, force, writer.writes_several_files(options)) as tmp:
        session = writer.open(tmp, source, plans, options)
        for rec, plan in tqdm(pairs, desc="Converting", unit="tensor", disable=not progress, leave=False):
            with kernel_trace() as used:  # which path dequantized and quantized it: the report's "kernel"
                item = rec.load()
                decoded = session.add(plan, item)
            reference = session.take_reference()  # the writer's own dequantization of the source, if it made one
            try:
                if isinstance(decoded, BitIdentical):
                    check_finite_copy(item)
                    max_err, rmse = 0.0, 0.0
                elif getattr(plan.action, "drop", False):
                    # not written (GGUF: a tower llama.cpp's converter leaves to its mmproj file): its values reach
                    # nothing, so an inf in them (Gemma 4's unclipped audio linears' input_max) is not refused
                    max_err, rmse = 0.0, 0.0
                else:
                    max_err, rmse = measure(item, decoded, reference)
            except NotFinite as e:  # no tensor is reported with a NaN or inf error
                raise _not_finite_refusal(e, rec, plan) from None
            del item, decoded, reference
            if plan.verdict == EXACT and max_err != 0.0:
                raise QConvertError(f"internal error: planned exact but measured max error {max_err:g}",
                                    tensor=rec.name)
            if plan.verdict == NEAR_EXACT and max_err == 0.0:
                plan.verdict = EXACT  # measured, not assumed: the rounding happened to be exact
            report.results.append(TensorResult(plan, max_err, rmse, kernel_summary(used)))
        session.close()
    report.seconds = time.perf_counter() - start
    return report
