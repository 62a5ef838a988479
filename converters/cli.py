"""The `qconvert` command line.

    qconvert 'gptq->gguf' SRC OUT [--type q4_0] [--allow-requant] [--dry-run] [--report r.json] [--force]
    qconvert gptq:gguf SRC OUT          (the same pair without quotes: an unquoted '>' is a shell redirect)
    qconvert formats                    (what each format can read and write)
    qconvert inspect PATH               (format, bits, group size and layout of a checkpoint)

Exit status: 0 on success, 2 on bad input or a refused plan (one line on stderr, no traceback), 1 for an
unexpected failure (a bug: one line naming the input; `--debug` shows the traceback), 130 on interrupt. No
partial output is ever left at OUT.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path

import click

from .. import __version__
from .errors import QConvertError, _printable
from .plan import Options
from .registry import all_formats, detect_format, get_format

__all__ = ["main", "cli", "detect_format"]

_PAIR = re.compile(r"^(?P<src>[A-Za-z0-9_.\-]+?)(?:->|:|=>)(?P<dst>[A-Za-z0-9_.\-]+)$")


class PairGroup(click.Group):
    """A click group that also accepts `SRC->DST` as a command name."""

    def get_command(self, ctx, name):
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

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        cmd = self.get_command(ctx, name) if name else None
        if cmd is None:
            return super().resolve_command(ctx, args)
        return name, cmd, args[1:]


@click.group(cls=PairGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconvert")
def cli():
    """Convert quantized LLM checkpoints between GPTQ, GGUF, HF (dense) and more.

    Convert with a pair command: qconvert 'gptq->gguf' SRC OUT (or gptq:gguf).

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


def parse_size(text: str) -> int:
    """`2G` -> 2_000_000_000 bytes: decimal units K/M/G/T as llama.cpp's gguf-split and converter read
    them (an optional trailing B is ignored); a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise QConvertError(f"--split-max-size expects a size such as 500M or 2G, got {text!r}")
    return int(float(m[1]) * 1000 ** "_KMGT".index(m[2].upper() or "_"))


def _print_plan(report, quiet: bool) -> None:
    if not quiet:
        header = f"{'tensor':<48} {'source':<22} {'target':<10} {'verdict':<11} {'max_abs_err':>11} {'rmse':>10}"
        click.echo(header)
        for r in report.results:
            p = r.plan
            err = "-" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
            rmse = "-" if r.rmse is None else f"{r.rmse:.3g}"
            click.echo(f"{p.name:<48} {p.source:<22} {p.target:<10} {p.verdict:<11} {err:>11} {rmse:>10}")
    for name, why in report.ignored_files.items():
        click.echo(f"ignored: {name} ({why})")
    s = report.summary()
    counts = ", ".join(f"{v} {k}" for k, v in s["verdicts"].items() if v)
    click.echo(f"{s['tensors']} tensors: {counts}; max abs error {s['max_abs_err']}; {s['seconds']} s"
               + (" (dry run: nothing written)" if report.dry_run else f" -> {report.output_path}"))


def _make_convert_command(src: str, dst: str) -> click.Command:
    @click.command(name=f"{src}->{dst}", help=f"Convert a {src} checkpoint into {dst}.")
    @click.argument("src_path", type=click.Path(path_type=Path))
    @click.argument("out_path", type=click.Path(path_type=Path), required=False)
    @click.option("--type", "type_", help="target type for quantized tensors (gguf: q4_0, q4_1, q8_0, q4_k, f16..., "
                                          "or a llama-quantize mix: q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q3_k_m, q2_k; "
                                          "gptq: 4g128, 4g32a...; hf: bf16, f16, f32)")
    @click.option("--tensor-type", multiple=True, metavar="REGEX=TYPE", help="per-tensor type override, first match wins")
    @click.option("--allow-requant", is_flag=True, help="accept lossy requantization where the grids do not align")
    @click.option("--dry-run", is_flag=True, help="print the per-tensor plan with verdicts; write nothing")
    @click.option("--report", "report_path", type=click.Path(path_type=Path), help="write a JSON report of every tensor")
    @click.option("--force", is_flag=True, help="replace an existing output")
    @click.option("--quiet", is_flag=True, help="print only the summary line")
    @click.option("--split-max-size", metavar="SIZE", help="gguf: split the output into parts of at most SIZE "
                                                          "(e.g. 500M, 2G) named OUT-0000i-of-0000N.gguf")
    @click.option("--imatrix", "imatrix", type=click.Path(path_type=Path), help="gguf: llama.cpp importance matrix "
                  "(llama-imatrix .dat or GGUF) weighting the K quantizers as llama-quantize --imatrix does")
    @click.option("--quantizer", type=click.Choice(["qconvert", "llama.cpp"]), default=None,
                  help="gguf: whose quantizer requantizes (default qconvert's own; llama.cpp needs llama-cpp-python)")
    def command(src_path, out_path, type_, tensor_type, allow_requant, dry_run, report_path, force, quiet,
                split_max_size, imatrix, quantizer):
        from .run import convert

        if out_path is None and not dry_run:
            raise click.UsageError("OUT_PATH is required unless --dry-run is given")
        options = Options(type=type_, tensor_types=_parse_tensor_types(tensor_type), allow_requant=allow_requant)
        if split_max_size is not None:
            if get_format(dst).name != "gguf":
                raise QConvertError("--split-max-size applies to gguf output only")
            options.extra["split_max_size"] = parse_size(split_max_size)
        if imatrix is not None:
            options.extra["imatrix"] = str(imatrix)
        if quantizer is not None:
            options.extra["quantizer"] = quantizer
        report = convert(src, src_path, dst, out_path, options, force=force, dry_run=dry_run,
                         progress=sys.stderr.isatty())
        _print_plan(report, quiet)
        if report_path:
            report.write_json(report_path)

    return command


@cli.command("formats")
def formats_command():
    """List every format with what qconvert can read and write."""
    for entry in all_formats():
        rw = ("read" if entry.can_read else "    ") + " " + ("write" if entry.can_write else "     ")
        aliases = f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else ""
        click.echo(f"{entry.name:<10} {rw}  {entry.description}{aliases}")


@cli.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", help="read as this format instead of detecting it")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def inspect_command(path, fmt, as_json):
    """Name the format, bits, group size and layout of a checkpoint."""
    from .align import describe_grid

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


@cli.command("verify")
@click.argument("src_path", type=click.Path(path_type=Path))
@click.argument("out_path", type=click.Path(path_type=Path))
@click.option("--src-format", help="read the source as this format instead of detecting it")
@click.option("--out-format", help="read the output as this format instead of detecting it")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="write the JSON report")
@click.option("--strict", is_flag=True, help="exit 3 unless every tensor is present and exact")
@click.option("--quiet", is_flag=True, help="print only the summary line")
def verify_command(src_path, out_path, src_format, out_format, report_path, strict, quiet):
    """Re-read OUT and measure every tensor against SRC's dequantization (both read from disk)."""
    from .run import verify

    report = verify(src_path, out_path, src_format, out_format, progress=sys.stderr.isatty())
    _print_plan(report, quiet)
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
            return _fail(f"qconvert: error: {_unexpected(e, args)}", 1, held, debug)
    held.flush()
    return status


def _fail(line: str, status: int, held: "_HeldWarnings", debug: bool) -> int:
    if debug:
        held.flush()
    click.echo(line, err=True)
    return status


def _unexpected(e: BaseException, args: list[str]) -> str:
    paths = [a for a in args[1:] if not a.startswith("-") and Path(a).exists()]
    where = f"{paths[0]}: " if paths else ""
    detail = _printable(" ".join(str(e).split()))[:160]
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
