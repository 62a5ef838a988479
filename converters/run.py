"""The runner: plan, check, then convert one tensor at a time into a temporary output, measure every
tensor's error against the source dequantization, and rename the output into place only on success.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .checker import EXACT, NEAR_EXACT, REQUANTIZE
from .errors import BadInput, QConvertError
from .plan import BitIdentical, Options, TensorPlan, check_plan, verdict_counts
from .registry import get_format
from .validate import ConfigView
from .model_shapes import Layout, known_layout
from ..kernels import kernel_trace

__all__ = ["convert", "verify", "open_source", "plan_conversion", "TensorResult", "Report", "atomic_output"]


@dataclass
class TensorResult:
    plan: TensorPlan
    max_abs_err: float | None = None
    rmse: float | None = None
    kernel: dict | None = None  # stage -> the path that ran it: {"dequantize": "triton", "quantize": "c"}

    def as_dict(self) -> dict:
        p = self.plan
        return {"name": p.name, "out_name": p.out_name, "shape": list(p.shape), "source": p.source,
                "target": p.target, "verdict": p.verdict, "reason": p.reason,
                "max_abs_err": self.max_abs_err, "rmse": self.rmse,
                **({"kernel": self.kernel} if self.kernel is not None else {})}


@dataclass
class Report:
    source_format: str
    target_format: str
    source_path: str
    output_path: str | None
    results: list[TensorResult] = field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False
    ignored_files: dict = field(default_factory=dict)  # files beside the source that are not part of the model
    not_carried: dict = field(default_factory=dict)  # tensors of the source no record carries, with why
    logits: dict | None = None  # `verify --logits`: quality.LogitReport.as_dict()

    def summary(self) -> dict:
        plans = [r.plan for r in self.results]
        errs = [r.max_abs_err for r in self.results if r.max_abs_err is not None]
        return {"tensors": len(plans), "verdicts": verdict_counts(plans),
                "max_abs_err": max(errs) if errs else None, "seconds": round(self.seconds, 3),
                "dry_run": self.dry_run}

    def as_dict(self) -> dict:
        return {"source": {"format": self.source_format, "path": self.source_path, "ignored_files": self.ignored_files,
                           "not_carried": self.not_carried},
                "target": {"format": self.target_format, "path": self.output_path},
                "tensors": [r.as_dict() for r in self.results], "summary": self.summary(),
                **({"logits": self.logits} if self.logits is not None else {})}

    def write_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")


def open_source(fmt: str, path: Path, options: Options | None = None):
    entry = get_format(fmt)
    if not entry.can_read:
        raise QConvertError(f"format {entry.name!r} cannot be read yet")
    return entry.open_reader(Path(path), **((options.extra if options else {}) or {}))


def writer_records(source, writer):
    """The records a writer takes, in order: the source's, unless the writer's format splits some tensors
    into several of its own (a writer's optional `adapt_records(records, source)`; GGUF's DeepSeek
    kv_b_proj becomes the attn_k_b and attn_v_b llama.cpp loads). Planning and writing both read it, so
    they see the same records in the same order."""
    adapt = getattr(writer, "adapt_records", None)
    return source.records() if adapt is None else adapt(source.records(), source)


def plan_conversion(source, writer, options: Options, progress: bool = True) -> list[TensorPlan]:
    plans, names, files = [], [], {}
    for rec in tqdm(writer_records(source, writer), desc="Checking", unit="tensor", disable=not progress, leave=False):
        names.append(rec.name)
        files[rec.name] = rec.source_file
        plans.append(_mark_standin(rec, writer.plan_tensor(rec, options, source)))
    check_required_tensors(source, names, files)
    writer.check_model(source, plans, options)
    return plans


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_LAYERS = 1 << 16  # the deepest released models have ~130 layers


def check_required_tensors(source, names: list[str], files: dict[str, str] | None = None) -> None:
    """What every model needs whatever its format, checked on the records' (Hugging Face) names, which
    every reader yields alike (one `<module>.weight` per quantized linear): some tensors at all;
    `lm_head.weight` when config.json unties it from the embedding (transformers would otherwise start
    the head from random values); every decoder layer below num_hidden_layers (a layer may be stored in
    several shards, but none may be absent).

    For the architectures whose names are known (model_shapes.KNOWN_LAYOUTS: llama, mistral, qwen2,
    qwen3) also: no name the architecture does not have (a renamed or foreign tensor, a layer at or
    beyond num_hidden_layers), and every tensor of the model present, in every layer (the biases where
    config.json says the model has them). Other architectures keep only the layer count, with layers
    beyond it allowed: DeepSeek-V3 stores its multi-token-prediction layer as
    model.layers.<num_hidden_layers>, and MoE, hybrid (attention / state-space) and pruned models hold
    different tensors in different layers, so no per-layer rule is safe for them.

    `files` maps names to the records' source_file, to name the file in a refusal."""
    path = Path(getattr(source, "path", "") or ".")
    files = files or {}
    if not names:
        shards = getattr(getattr(source, "ckpt", None), "shards", None) or []
        raise BadInput("the checkpoint holds no tensors", path=path / shards[0] if len(shards) == 1 else path)
    config = getattr(source, "config", None)
    if not isinstance(config, dict):
        return
    where = path / "config.json" if path.is_dir() and (path / "config.json").exists() else path
    view = ConfigView(config, where)
    present = set(names)

    def file_of(name: str) -> Path:
        f = files.get(name)
        if not f:
            return path
        f = Path(f)
        return f if f.is_absolute() else (path / f if path.is_dir() else path.with_name(f.name))

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


def _not_in_layout(name: str, layout: Layout, n_layers: int | None) -> str:
    m = _LAYER_NAME.match(name)
    if m and n_layers is not None and int(m[1]) >= n_layers:
        return (f"layer {m[1]} is beyond config.json's num_hidden_layers {n_layers} ({layout.model_type} models "
                "have no extra layers)")
    return (f"not a tensor of {layout.class_name} (config.json's model_type {layout.model_type!r}): a renamed or "
            "foreign tensor")


def _mark_standin(rec, plan: TensorPlan) -> TensorPlan:
    """A source may yield a float stand-in for a quantized tensor whose own form the target cannot hold
    (a rotated GPTQ down_proj with its online transform folded in): `rec.lossy_standin` says why.
    Storing the stand-in loses the source's grid, so the plan is `requantize` whatever the target type,
    unless the writer kept the source's own form (`info["keeps_source_form"]`)."""
    why = rec.lossy_standin
    if why and plan.verdict in (EXACT, NEAR_EXACT) and not plan.info.get("keeps_source_form"):
        plan.verdict, plan.reason = REQUANTIZE, f"{why} (stored as: {plan.reason})" if plan.reason else why
    return plan


@contextmanager
def atomic_output(out: Path, is_file: bool, force: bool, several_files: bool = False):
    """Yield a temporary path next to `out`; rename it to `out` only if the block succeeds.

    `several_files`: the writer may write more files next to `out` than `out` itself (split GGUF
    parts named after it). It gets `<temporary folder>/<out's name>` and writes every file in that
    folder; only when all are written are they renamed next to `out`, after checking that none would
    replace an existing file without `force`."""
    out = Path(out)
    if out.exists() and not force:
        raise QConvertError("output exists; pass --force to replace it", path=out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = out.with_name(f".{out.name}{_TMP_MARK}{_HOST}-{os.getpid()}")
    _remove(tmp)
    if not is_file or several_files:
        tmp.mkdir()
    try:
        if not several_files:
            yield tmp
            if out.exists():
                _remove(out)
            os.replace(tmp, out)
            return
        yield tmp / out.name
        written = sorted(tmp.iterdir())
        clashes = [out.with_name(p.name) for p in written if out.with_name(p.name).exists()]
        if clashes and not force:
            raise QConvertError("output exists; pass --force to replace it", path=clashes[0])
        for p in written:
            _remove(out.with_name(p.name))
            os.replace(p, out.with_name(p.name))
    finally:
        _remove(tmp)


# A temporary output is `.<out name>.qconvert-tmp-<host>-<pid>`: a run killed with SIGKILL cannot remove
# its own, so every run removes those beside its output whose process (on this host) is gone.
_TMP_MARK = ".qconvert-tmp-"
_HOST = socket.gethostname().replace("-", "_") or "host"
_TMP_NAME = re.compile(r"^\..+\.qconvert-tmp-(?P<host>[^-]+)-(?P<pid>\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporaries in `folder` left by qconvert runs on this host whose process no longer
    exists (killed runs); those of live runs, and of other hosts sharing the folder, stay."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_NAME.match(entry.name)
        if m and m["host"] == _HOST and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            _remove(entry)
            removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


_MEASURE_CHUNK = 1 << 18  # elements of source dequantization alive at once while measuring (about 40 B each)


def _measure(item, decoded: torch.Tensor, reference: torch.Tensor | None = None) -> tuple[float, float]:
    """Max abs error and RMSE of `decoded` against the source's float32 dequantization, computed a
    band of rows at a time so that measuring never holds a second full-size float copy. `reference`:
    that dequantization when the writer already made it to encode the tensor (the same values, so the
    same numbers), else each band of the source is dequantized here."""
    if decoded.numel() == 0:
        return 0.0, 0.0
    if reference is not None and tuple(reference.shape) != tuple(decoded.shape):
        reference = None
    rows = decoded.shape[0] if decoded.dim() > 1 else 1
    step = max(1, _MEASURE_CHUNK // max(1, decoded.numel() // rows))
    max_err, sum_sq = 0.0, 0.0
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if reference is not None:
            ref = reference[start:stop] if decoded.dim() > 1 else reference
        else:
            part = item.row_slice(start, stop) if decoded.dim() > 1 else item
            ref = part.dequantize(torch.float32)
        got = decoded[start:stop] if decoded.dim() > 1 else decoded
        diff = (got.to(torch.float32) - ref).abs()
        max_err = max(max_err, float(diff.max()))
        sum_sq += float(diff.double().pow(2).sum())
    return max_err, (sum_sq / decoded.numel()) ** 0.5


def device_scope(device: str | None):
    """`with device_scope(options.device):` the kernels run on that device (kernels.use_device); an absent
    device is a QConvertError (one line, exit 2) before anything is read or written."""
    from ..kernels import resolve_device, use_device

    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise QConvertError(str(e)) from None
    return use_device(dev)


def kernel_summary(trace: dict) -> dict:
    """kernels.kernel_trace's {stage: [paths]} -> {stage: "triton"} ("triton+c" where parts took each)."""
    return {stage: "+".join(paths) for stage, paths in trace.items()}


def convert(src_format: str, src_path: Path, dst_format: str, out_path: Path | None,
            options: Options, *, force: bool = False, dry_run: bool = False,
            progress: bool = True) -> Report:
    """Convert on `options.device` (tensors move there one at a time); see _convert."""
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
    writer = target.writer
    if out_path is not None and not dry_run and Path(out_path).exists() and not force:
        raise QConvertError("output exists; pass --force to replace it", path=out_path)
    source = open_source(src_format, src_path, options)
    # a writer that decides something once per model (the GGUF architecture, the QQQ target group) gives a
    # fresh object holding it for this conversion: nothing is stored on the source or the shared writer
    begin = getattr(writer, "for_conversion", None)
    if begin is not None:
        writer = begin(source, options)
    plans = plan_conversion(source, writer, options, progress)
    report = Report(source.format_name, target.name, str(src_path), None if dry_run else str(out_path),
                    dry_run=dry_run, ignored_files=dict(getattr(source, "ignored_files", None) or {}),
                    not_carried=dict(getattr(source, "not_carried", None) or {}))
    if dry_run:
        report.results = [TensorResult(p) for p in plans]
        report.seconds = time.perf_counter() - start
        return report
    check_plan(plans, options.allow_requant)

    by_name = {p.name: p for p in plans}
    several = bool(getattr(writer, "writes_several_files", lambda _: False)(options))
    with atomic_output(Path(out_path), writer.output_is_file, force, several) as tmp:
        session = writer.open(tmp, source, plans, options)
        bar = tqdm(total=len(plans), desc="Converting", unit="tensor", disable=not progress, leave=False)
        for rec in writer_records(source, writer):
            plan = by_name[rec.name]
            with kernel_trace() as used:  # which path dequantized and quantized it: the report's "kernel"
                item = rec.load()
                decoded = session.add(plan, item)
            take = getattr(session, "take_reference", None)  # the writer's own dequantization of the source
            reference = take() if take is not None else None
            max_err, rmse = ((0.0, 0.0) if isinstance(decoded, BitIdentical)
                             else _measure(item, decoded, reference))
            del item, decoded, reference
            if plan.verdict == EXACT and max_err != 0.0:
                raise QConvertError(f"internal error: planned exact but measured max error {max_err:g}",
                                    tensor=rec.name)
            if plan.verdict == NEAR_EXACT and max_err == 0.0:
                plan.verdict = EXACT  # measured, not assumed: the rounding happened to be exact
            report.results.append(TensorResult(plan, max_err, rmse, kernel_summary(used)))
            bar.update()
        bar.close()
        session.close()
    report.seconds = time.perf_counter() - start
    return report


def verify(src_path: Path, out_path: Path, src_format: str | None = None, out_format: str | None = None,
           progress: bool = True, device: str | None = None) -> Report:
    """_verify with the dequantizations on `device` (kernels.use_device)."""
    with device_scope(device):
        return _verify(src_path, out_path, src_format, out_format, progress)


def _verify(src_path: Path, out_path: Path, src_format: str | None = None, out_format: str | None = None,
            progress: bool = True) -> Report:
    """Re-read a converted model with qconvert's readers and measure every tensor against the source.

    Independent of the conversion's own report: both sides are opened from disk by format, matched by
    their Hugging Face names, dequantized to float32 and compared. Verdicts here are what the numbers
    say: `exact` (max error 0), `differs` (with the error), `missing` (not in the output).
    """
    from .records import canonical_name, describe_record
    from .registry import detect_format

    start = time.perf_counter()
    source = open_source(src_format or detect_format(src_path), src_path)
    output = open_source(out_format or detect_format(out_path), out_path)
    # matched by the names transformers loads them by (a writer may rename what a producer renamed)
    out_records = {canonical_name(r.name, output.config): r for r in output.records()}
    report = Report(source.format_name, output.format_name, str(src_path), str(out_path))
    for rec in tqdm(list(source.records()), desc="Verifying", unit="tensor", disable=not progress, leave=False):
        target = out_records.get(canonical_name(rec.name, source.config))
        if target is None:
            plan = TensorPlan(rec.name, rec.shape, describe_record(rec), "-", "missing", "not in the output")
            report.results.append(TensorResult(plan))
            continue
        if tuple(target.shape) != tuple(rec.shape):
            raise QConvertError(f"shape {tuple(target.shape)} in the output, {tuple(rec.shape)} in the source",
                                path=out_path, tensor=rec.name)
        with kernel_trace() as used:
            max_err, rmse = _measure(rec.load(), target.load().dequantize(torch.float32))
        plan = TensorPlan(rec.name, rec.shape, describe_record(rec), describe_record(target),
                          "exact" if max_err == 0.0 else "differs")
        report.results.append(TensorResult(plan, max_err, rmse, kernel_summary(used)))
    report.seconds = time.perf_counter() - start
    return report
