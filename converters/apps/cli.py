"""The `qconvert` command line.

    qconvert 'gptq->gguf' SRC OUT [--type q4_0] [--allow-requant] [--dry-run] [--report r.json] [--force]
    qconvert gptq:gguf SRC OUT          (the same pair without quotes: an unquoted '>' is a shell redirect)
    qconvert convert SRC OUT --to gguf  (the same, the source format detected; or given with --from)
    qconvert formats                    (what each format can read and write)
    qconvert inspect PATH               (format, bits, group size and layout of a checkpoint)
    qconvert verify SRC OUT [--logits]  (re-read OUT, measure every tensor against SRC; and run both models)
    qconvert batch MANIFEST             (many conversions: local workers, or a Ray cluster with --ray)

Exit status: 0 on success, 2 on bad input or a refused plan (one line on stderr, no traceback), 1 for an
unexpected failure (a bug: one line naming the input; `--debug` shows the traceback) or a disk that cannot hold
the output (one line saying so), 130 on interrupt. No partial output is ever left at OUT.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path

# Before torch loads (the imports below bring it): OpenMP threads wait passively at barriers unless the user
# chose otherwise. By default libgomp spins, and with another process on a core a thread spins while its
# partner is descheduled: on this 2-core machine with a test run on the other core, a 4-layer GPTQ -> Q4_0
# conversion took 5.3-6.3 s spinning and 2.0-2.1 s passive (its own reported time), same bytes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click  # noqa: E402

from ... import __version__  # noqa: E402
from ..errors import QConvertError, printable
from ..plan import Options
from ..registry import FormatEntry, OptionSpec, all_formats, declared_options, detect_format, get_format

__all__ = ["main", "cli", "detect_format", "writer_extra"]

_PAIR = re.compile(r"^(?P<src>[A-Za-z0-9_.\-]+?)(?:->|:|=>)(?P<dst>[A-Za-z0-9_.\-]+)$")


_DETECTING_COMMAND = "convert"


class PairGroup(click.Group):
    """A click group that also accepts `SRC->DST` as a command name, and builds `convert` for the target its
    `--to` names (so that its --help shows that target's types and options)."""

    def get_command(self, ctx, name):
        if name == _DETECTING_COMMAND:
            return _make_detecting_command(None)
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            return cmd
        m = _PAIR.match(name)
        if m:
            return _make_convert_command(m["src"], m["dst"])
        if name.endswith("-"):
            raise click.UsageError(f"{name!r}: quote the pair, e.g. '{name}>gguf' (unquoted, the shell takes '>' as a "
                                   "redirect), or write it as SRC:DST")
        return None

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), _DETECTING_COMMAND])

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name == _DETECTING_COMMAND:
            return name, _make_detecting_command(_known_target(_peek_option(args[1:], "--to"))), args[1:]
        cmd = self.get_command(ctx, name) if name else None
        if cmd is None:
            return super().resolve_command(ctx, args)
        return name, cmd, args[1:]

    def format_epilog(self, ctx, formatter):
        """The pairs and examples come from the registry, so the help names only what exists."""
        with formatter.section("Pairs (SRC->DST or SRC:DST)"):
            formatter.write_dl(_pair_rows())
        with formatter.section("Examples"):
            for example in _help_examples():
                formatter.write(f"{'':>{formatter.current_indent}}{example}\n")


def _pair_rows() -> list[tuple[str, str]]:
    """One row per readable format: the formats it converts into."""
    writable = ", ".join(e.name for e in all_formats() if e.can_write)
    return [(e.name, f"-> {writable}") for e in all_formats() if e.can_read]


def _help_examples() -> list[str]:
    """The first example each writable format declares: one command per target keeps the help short."""
    return [e.examples[0] for e in all_formats() if e.can_write and e.examples]


@click.group(cls=PairGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconvert")
def cli():
    """Convert quantized LLM checkpoints between GPTQ, GGUF, HF (dense) and more.

    Convert with a pair command: qconvert 'gptq->gguf' SRC OUT (or gptq:gguf), or let qconvert detect
    the source: qconvert convert SRC OUT --to gguf. An option a target does not take is refused.

    Errors are one line (exit 2 for bad input or a refused plan, 1 for a bug in qconvert); add --debug
    anywhere on the command line to see a bug's traceback and the warnings held back.
    """


def _parse_tensor_types(values) -> list[tuple[str, str]]:
    out = []
    for v in values:
        if "=" not in v:
            raise QConvertError(f"--tensor-type expects REGEX=TYPE, got {v!r}")
        pattern, type_name = v.rsplit("=", 1)
        try:
            re.compile(pattern)
        except re.error as e:
            raise QConvertError(f"--tensor-type pattern {pattern!r} is not a regular expression ({e})") from None
        out.append((pattern, type_name))
    return out


def parse_size(text: str, flag: str = "--split-max-size") -> int:
    """`2G` -> 2_000_000_000 bytes: decimal units K/M/G/T as llama.cpp's gguf-split and converter read
    them (an optional trailing B is ignored); a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise QConvertError(f"{flag} expects a size such as 500M or 2G, got {text!r}")
    return int(float(m[1]) * 1000 ** "_KMGT".index(m[2].upper() or "_"))


def _print_plan(report, quiet: bool) -> None:
    if not quiet:
        kernels = any(r.kernel for r in report.results)  # a column only when some tensor went through a kernel
        header = f"{'tensor':<48} {'source':<22} {'target':<10} {'verdict':<11} {'max_abs_err':>11} {'rmse':>10}"
        click.echo(header + (f" {'kernel'}" if kernels else ""))
        for r in report.results:
            p = r.plan
            err = "-" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
            rmse = "-" if r.rmse is None else f"{r.rmse:.3g}"
            click.echo(f"{p.name:<48} {p.source:<22} {p.target:<10} {p.verdict:<11} {err:>11} {rmse:>10}"
                       + (f" {kernel_label(r.kernel)}" if kernels else ""))
    for name, why in report.ignored_files.items():
        click.echo(f"ignored: {name} ({why})")
    by_reason: dict[str, list[str]] = {}
    for name, why in report.not_carried.items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():  # one line per reason: a model has one scale per layer and projection
        click.echo(f"not carried: {len(names)} tensor(s) ({why}), e.g. {names[0]}")
    s = report.summary()
    counts = ", ".join(f"{v} {k}" for k, v in s["verdicts"].items() if v)
    click.echo(f"{s['tensors']} tensors: {counts}; max abs error {s['max_abs_err']}; {s['seconds']} s"
               + (" (dry run: nothing written)" if report.dry_run else f" -> {report.output_path}"))


_STAGE_ABBREV = {"dequantize": "dq", "quantize": "q", "repack": "repack"}


def kernel_label(kernel: dict | None) -> str:
    """The plan table's kernel column: "triton" when one path ran every stage, else each stage's ("dq c q triton");
    "-" when no kernel ran (a float tensor passed as it is)."""
    if not kernel:
        return "-"
    paths = set(kernel.values())
    if len(paths) == 1:
        return paths.pop()
    return " ".join(f"{_STAGE_ABBREV.get(stage, stage)} {path}" for stage, path in kernel.items())


# options every conversion takes, whatever the target; a format may not declare one of these
_GENERIC_FLAGS = ("--type", "--tensor-type", "--allow-requant", "--dry-run", "--report", "--force", "--quiet",
                  "--to", "--from", "--device", "--workers", "--ray", "--part-size", "--worker-memory")
_DEVICE_HELP = ("where the kernels run: cpu (default), cuda[:N], or auto (CUDA when torch sees a device); tensors move "
                "there one at a time, and Triton kernels run where they exist (QCONVERT_KERNELS=torch|triton overrides)")
_WRITER_PARAM = "writer_"  # prefix of the click parameter names of writer options (never a generic name)


def _known_target(name: str | None) -> FormatEntry | None:
    """The format `name` names, or None when it names none (the command then fails when it runs)."""
    if not name:
        return None
    try:
        return get_format(name)
    except QConvertError:
        return None


def _peek_option(args: list[str], flag: str) -> str | None:
    """The value of `flag` (`--to gguf` or `--to=gguf`) in raw arguments, before click parses them."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return None


def _type_help(target: FormatEntry | None) -> str:
    if target is not None and target.type_help:
        return f"target type for quantized tensors ({target.name}: {target.type_help})"
    return ("target type for quantized tensors; `qconvert convert --to FMT --help` names the types of the "
            "target FMT")


def _generic_params(target: FormatEntry | None) -> list[click.Parameter]:
    return [
        click.Argument(["src_path"], type=click.Path(path_type=Path)),
        click.Argument(["out_path"], type=click.Path(path_type=Path), required=False),
        click.Option(["--type", "type_"], metavar="TYPE", help=_type_help(target)),
        click.Option(["--tensor-type"], multiple=True, metavar="REGEX=TYPE",
                     help="per-tensor type override, first match wins"),
        click.Option(["--allow-requant"], is_flag=True, help="accept lossy requantization where the grids do not align"),
        click.Option(["--dry-run"], is_flag=True, help="print the per-tensor plan with verdicts; write nothing"),
        click.Option(["--report", "report_path"], type=click.Path(path_type=Path),
                     help="write a JSON report of every tensor"),
        click.Option(["--force"], is_flag=True, help="replace an existing output"),
        click.Option(["--quiet"], is_flag=True, help="print only the summary line"),
        click.Option(["--device"], default="cpu", show_default=True, metavar="cpu|cuda|auto", help=_DEVICE_HELP),
        click.Option(["--workers"], type=click.IntRange(1, 4096), default=None, metavar="N",
                     help="split this one conversion into parts converted by N processes of this machine (gguf "
                          "output; same bytes; a re-run resumes a killed one)"),
        click.Option(["--ray", "ray_address"], is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
                     help="split this one conversion into parts run as Ray tasks: on a local Ray, or on the cluster "
                          "at ADDRESS (every node: the same install, SRC and OUT on a shared filesystem)"),
        click.Option(["--part-size"], metavar="SIZE", default=None,
                     help="with --workers/--ray: source values per part, as float32 bytes (default 1G)"),
        click.Option(["--worker-memory"], metavar="SIZE", default=None,
                     help="with --workers/--ray: the memory one worker may use (default: the machine's, or the "
                          "largest Ray node's); a part needing more is refused before any starts"),
    ]


def _param_name(spec: OptionSpec) -> str:
    return _WRITER_PARAM + spec.key


def _click_type(spec: OptionSpec):
    if spec.kind == "path":
        return click.Path(path_type=Path)
    if spec.kind == "choice":
        return click.Choice(list(spec.choices))
    return str  # "size" and "text": parsed (or passed on) by _writer_value


def _writer_params(target: FormatEntry | None) -> list[click.Option]:
    """Every format's declared options, so that one given for another target is refused by name instead
    of being an unknown option; those the known target does not take are left out of its --help."""
    params = []
    for flag, (spec, owners) in declared_options().items():
        if flag in _GENERIC_FLAGS:
            raise ValueError(f"format {owners[0]} declares {flag}, which every conversion takes already")
        hidden = target is not None and target.name not in owners
        if spec.kind == "flag":  # None when not given, as every other writer option (writer_extra skips it)
            params.append(click.Option([flag, _param_name(spec)], is_flag=True, flag_value=True, default=None,
                                       help=spec.help, hidden=hidden))
            continue
        params.append(click.Option([flag, _param_name(spec)], type=_click_type(spec), metavar=spec.metavar or None,
                                   help=spec.help, hidden=hidden))
    return params


def _writer_value(spec: OptionSpec, value):
    """The Options.extra value of a given option, as the writers read it."""
    if spec.kind == "size":
        return parse_size(value, spec.flag)
    if spec.kind == "path":
        return str(value)
    return value


def writer_extra(target: FormatEntry, given: dict[str, object]) -> dict:
    """Options.extra from the writer options given ({flag: value}, None = not given): one the target does
    not declare is refused, since its writer would ignore it."""
    extra = {}
    for flag, (spec, owners) in declared_options().items():
        value = given.get(flag)
        if value is None or value is False:  # not given (a flag left off reads False in some click versions)
            continue
        if target.name not in owners:
            raise QConvertError(f"{flag} applies to {' or '.join(owners)} output only (the target is {target.name})")
        extra[spec.key] = _writer_value(spec, value)
    return extra


def _given_writer_options(params: dict) -> dict[str, object]:
    """{flag: value} of the writer options in a command's parsed parameters."""
    return {flag: params.get(_param_name(spec)) for flag, (spec, _) in declared_options().items()}


def _run_conversion(src_format: str | None, target_name: str, params: dict) -> None:
    """What both conversion commands do: check the options against the target, detect the source format
    when none is given, convert, print the plan, write the report."""
    from ..run import convert

    if params["out_path"] is None and not params["dry_run"]:
        raise click.UsageError("OUT_PATH is required unless --dry-run is given")
    options = Options(type=params["type_"], tensor_types=_parse_tensor_types(params["tensor_type"]),
                      allow_requant=params["allow_requant"], device=_checked_device(params["device"]))
    options.extra.update(writer_extra(get_format(target_name), _given_writer_options(params)))
    detected = src_format is None
    if detected:
        src_format = detect_format(params["src_path"])
    split = params.get("workers") is not None or params.get("ray_address") is not None
    if not split and (params.get("part_size") or params.get("worker_memory")):
        raise QConvertError("--part-size and --worker-memory are for --workers or --ray")
    if split and not params["dry_run"]:
        report = _run_split(src_format, target_name, options, params)
    else:
        report = convert(src_format, params["src_path"], target_name, params["out_path"], options,
                         force=params["force"], dry_run=params["dry_run"], progress=sys.stderr.isatty())
    if detected and not params["quiet"]:
        # said after the conversion: after a failure the error line stands alone on stderr
        click.echo(f"detected source format: {src_format}", err=True)
    _print_plan(report, params["quiet"])
    if params["report_path"]:
        report.write_json(params["report_path"])


def _run_split(src_format: str, target_name: str, options: Options, params: dict):
    """One conversion in parts (converters/split.py) on --workers processes or --ray tasks."""
    from ..split import DEFAULT_PART_VALUES, ProcessWorkers, convert_split

    part_values = (parse_size(params["part_size"], "--part-size") // 4 if params.get("part_size")
                   else DEFAULT_PART_VALUES)
    worker_memory = parse_size(params["worker_memory"], "--worker-memory") if params.get("worker_memory") else None
    if params.get("ray_address") is not None:
        from .split_ray import RayWorkers

        workers = RayWorkers(params["ray_address"] or None, params.get("workers"))
    else:
        workers = ProcessWorkers(params["workers"])
    try:
        report, stats = convert_split(src_format, params["src_path"], target_name, params["out_path"], options,
                                      workers, force=params["force"], progress=sys.stderr.isatty(),
                                      part_values=max(1, part_values), worker_memory=worker_memory)
    finally:
        workers.close()
    if not params["quiet"]:
        click.echo(f"split: {stats.parts} part(s), {stats.kept} kept from an earlier run (verified), "
                   f"{stats.converted} converted", err=True)
    return report


def _checked_device(name: str):
    """--device as a torch.device, found here once (run.resolve_device_option): an absent device is refused in
    one line (exit 2) before anything is read or written."""
    from ..run import resolve_device_option

    return resolve_device_option(name)


def _make_convert_command(src: str, dst: str) -> click.Command:
    target = _known_target(dst)

    def command(**params):
        _run_conversion(src, dst, params)

    return click.Command(f"{src}->{dst}", callback=command, help=f"Convert a {src} checkpoint into {dst}.",
                         params=[*_generic_params(target), *_writer_params(target)])


def _make_detecting_command(target: FormatEntry | None) -> click.Command:
    def command(to_format, from_format, **params):
        _run_conversion(from_format, to_format, params)

    params = [*_generic_params(target),
              click.Option(["--to", "to_format"], required=True, metavar="FMT", help="the target format"),
              click.Option(["--from", "from_format"], metavar="FMT",
                           help="read the source as this format instead of detecting it"),
              *_writer_params(target)]
    return click.Command(_DETECTING_COMMAND, callback=command, params=params,
                         short_help="Convert SRC into the format --to names, detecting SRC's format.",
                         help="Convert SRC into the format --to names, detecting SRC's format (as inspect does) "
                              "unless --from names it; the options and the output are those of the pair "
                              "command qconvert 'FROM->TO'.")


@cli.command("formats")
def formats_command():
    """List every format with what qconvert can read and write."""
    entries = all_formats()
    width = max(len(e.name) for e in entries)  # one column of names, however long the longest
    for entry in entries:
        rw = ("read" if entry.can_read else "    ") + " " + ("write" if entry.can_write else "     ")
        aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
        click.echo(f"{entry.name:<{width}} {rw}  {entry.description}{aliases}")


@cli.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", help="read as this format instead of detecting it")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def inspect_command(path, fmt, as_json):
    """Name the format, bits, group size and layout of a checkpoint."""
    from ..checker import describe_grid

    fmt = fmt or detect_format(path)
    entry = get_format(fmt)
    if not entry.can_read:
        raise QConvertError(f"format {entry.name!r} cannot be read yet", path=path)
    source = entry.open_reader(Path(path))
    info = dict(source.describe())
    schemes: dict[str, int] = {}
    for rec in source.records():
        key = describe_grid(rec.params, rec.shape[1]) if rec.is_grid else f"dense {rec.dtype}"
        schemes[key] = schemes.get(key, 0) + 1
    info["tensors_by_scheme"] = schemes
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for k, v in info.items():
        click.echo(f"{k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}")


@cli.command("batch")
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("--workers", type=int, default=None, help="parallel jobs (default: what the cores and memory allow)")
@click.option("--report", "report_dir", type=click.Path(path_type=Path),
              help="where batch.json, batch.md and the resume markers go (default: batch-report/ beside the manifest)")
@click.option("--dry-run", is_flag=True, help="list every job and whether it would run or is done; write nothing")
@click.option("--force", is_flag=True, help="replace outputs that exist but were not completed by this batch")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="run each job as a Ray task: on a local Ray started for the batch, or on the cluster at ADDRESS "
                   "(HOST:PORT; the paths must be shared by every node)")
@click.option("--verify", is_flag=True,
              help="the quality gate: after each conversion, `qconvert verify SRC OUT --logits` (KL, top-1, perplexity)")
@click.option("--max-kl", type=click.FloatRange(min=0), default=None,
              help="with --verify: a job whose mean KL is above this fails the gate (exit 1)")
def batch_command(manifest, workers, report_dir, dry_run, force, ray_address, verify, max_kl):
    """Run the conversions a manifest lists (jobs and/or a matrix); resumable: done jobs are skipped."""
    from .batch import job_counts, load_manifest, run_batch

    if max_kl is not None and not verify:
        raise QConvertError("--max-kl is for --verify")
    jobs = load_manifest(manifest)
    report_dir = report_dir or Path(manifest).parent / "batch-report"
    results = run_batch(jobs, report_dir, workers, dry_run=dry_run, force=force, progress=sys.stderr.isatty(),
                        use_ray=ray_address is not None, ray_address=ray_address or None, verify=verify,
                        max_kl=max_kl)
    for r in results:
        quality = "" if not r.verify else \
            f"; {r.verify}" if r.verify != "measured" else \
            f"; KL mean {r.kl_mean:.4g}, top-1 {r.top1_agreement:.4f}" + (f", {r.gate}" if r.gate else "")
        click.echo(f"{r.status:<8} {r.pair:<16} {r.src} -> {r.out}" + (f": {r.error}" if r.error else "") + quality)
    counts = job_counts(results)
    click.echo(", ".join(f"{v} {k}" for k, v in counts.items() if v) + f"; report: {Path(report_dir) / 'batch.md'}")
    if counts["failed"] or counts["verify failed"]:
        raise click.exceptions.Exit(1)


@cli.command("verify")
@click.argument("src_path", type=click.Path(path_type=Path))
@click.argument("out_path", type=click.Path(path_type=Path))
@click.option("--src-format", help="read the source as this format instead of detecting it")
@click.option("--out-format", help="read the output as this format instead of detecting it")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="write the JSON report")
@click.option("--strict", is_flag=True, help="exit 3 unless every tensor is present and exact")
@click.option("--quiet", is_flag=True, help="print only the summary line")
@click.option("--logits", is_flag=True,
              help="also run SRC and OUT in their runtimes (transformers, gptqmodel, llama.cpp, mistral.rs) on the same tokens: "
                   "KL divergence, top-1 agreement, perplexity")
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path),
              help="with --logits: a text file of prompts separated by blank lines (default: a bundled text)")
@click.option("--max-tokens", type=click.IntRange(2, 1 << 16), default=128, show_default=True,
              help="with --logits: tokens per prompt")
@click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda|auto", help=_DEVICE_HELP)
def verify_command(src_path, out_path, src_format, out_format, report_path, strict, quiet, logits, prompts_path,
                   max_tokens, device):
    """Re-read OUT and measure every tensor against SRC's dequantization (both read from disk); with --logits,
    compare the two models' predictions too."""
    from .verify import verify

    if prompts_path is not None and not logits:
        raise QConvertError("--prompts is for --logits")
    device = _checked_device(device)
    if logits:
        from .logits import compare_logits, read_prompts

        prompts = read_prompts(prompts_path)  # a bad prompts file fails before any model is read
    report = verify(src_path, out_path, src_format, out_format, progress=sys.stderr.isatty(), device=device)
    if logits:
        src_fmt = get_format(src_format).name if src_format else detect_format(src_path)
        out_fmt = get_format(out_format).name if out_format else detect_format(out_path)
        quality = compare_logits(src_fmt, src_path, out_fmt, out_path, prompts, max_tokens)
        report.logits = quality.as_dict()
    _print_plan(report, quiet)
    if logits:
        click.echo(quality.line())
    if report_path:
        report.write_json(report_path)
    if strict and any(r.plan.verdict != "exact" for r in report.results):
        raise click.exceptions.Exit(3)


def main(argv=None) -> int:
    """Run the CLI; return the exit status. Every failure ends as one line on stderr: a `QConvertError`
    (bad input, refused plan) exits 2; anything else is a bug, reported in one line naming the input with
    exit 1 (`--debug` anywhere on the line, or QCONVERT_DEBUG=1, shows the traceback instead).

    Warnings of the libraries underneath (and of our own loggers) are held back while the command runs:
    after a failure the error line stands alone; after a success they follow the output, once each."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("QCONVERT_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    held = _HeldWarnings()
    with held:
        try:
            rv = cli.main(args=args, prog_name="qconvert", standalone_mode=False)
            status = rv if isinstance(rv, int) else 0  # click returns an Exit's code instead of raising it here
        except QConvertError as e:
            return _fail(f"qconvert: error: {e}", 2, held, debug)
        except click.exceptions.Exit as e:
            status = e.exit_code
        except click.ClickException as e:
            if debug:
                held.flush()
            e.show()
            return 2
        except (click.exceptions.Abort, KeyboardInterrupt):
            return _fail("qconvert: interrupted", 130, held, debug)
        except BrokenPipeError:  # `qconvert formats | head`
            return 0
        except Exception as e:  # a bug: one line naming the input, the traceback only on request
            if debug:
                held.flush()
                traceback.print_exc()
                return 1
            full = _disk_full(e)
            if full:  # the machine's, not the input's nor a bug: atomic_output has removed the partial output
                return _fail(f"qconvert: error: {full}", 1, held, debug)
            return _fail(f"qconvert: error: {_unexpected(e, args)}", 1, held, debug)
    held.flush()
    return status


def _fail(line: str, status: int, held: "_HeldWarnings", debug: bool) -> int:
    if debug:
        held.flush()
    click.echo(line, err=True)
    return status


_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
# numpy's tofile and a short fwrite raise OSError without an errno: "N requested and M written"
_SHORT_WRITE = re.compile(r"\b\d+ requested and \d+ written\b")


def _disk_full(e: BaseException) -> str | None:
    """The line for a write the disk could not hold (no space, a quota, a file size limit), else None."""
    if not isinstance(e, OSError):
        return None
    if e.errno in _FULL_ERRNOS:
        why = os.strerror(e.errno).lower()
    elif e.errno is None and _SHORT_WRITE.search(str(e)):
        why = f"a write stopped short ({e}): the disk is probably full"
    else:
        return None
    where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
    return f"{why}{where}; nothing was left at the destination: free some space (or write elsewhere) and run again"


def _unexpected(e: BaseException, args: list[str]) -> str:
    paths = [a for a in args[1:] if not a.startswith("-") and Path(a).exists()]
    where = f"{paths[0]}: " if paths else ""
    detail = printable(" ".join(str(e).split()))[:160]
    what = type(e).__name__ + (f" ({detail})" if detail else "")
    return (f"{where}unexpected {what}; this is a bug in qconvert: please report it with the output of "
            f"the same command run with --debug")


class _HeldWarnings(logging.Handler):
    """Collects Python warnings and log records (WARNING and above), in the order they come, while a command
    runs, instead of letting them reach stderr before the command's own output or error line."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._catch = warnings.catch_warnings()  # restores the filters and showwarning on exit

    def emit(self, record: logging.LogRecord) -> None:
        self._hold(record.getMessage())

    def _hold(self, message: object) -> None:
        line = " ".join(str(message).split())
        if line and line not in self.messages:
            self.messages.append(line)

    def __enter__(self):
        self._catch.__enter__()
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *_, **__: self._hold(message)
        root = logging.getLogger()
        root.addHandler(self)
        self._old_level = root.level
        if root.level > logging.WARNING or root.level == logging.NOTSET:
            root.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self._old_level)
        self._catch.__exit__(*exc)

    def flush(self) -> None:
        for message in self.messages:
            click.echo(f"qconvert: warning: {message}", err=True)
        self.messages.clear()


if __name__ == "__main__":
    sys.exit(main())


def console_main() -> None:
    sys.exit(main())
