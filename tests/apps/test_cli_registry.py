"""The command line built from the registry: each format's declared target options are taken for it and
refused by name for every other target, `convert --to` detects the source and does what the pair command
does, and --help names the pairs, types and examples the registry holds."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from qconvert.converters.apps import cli
from qconvert.converters.registry import all_formats, declared_options, get_format
from helpers import write_legacy_imatrix

WRITABLE = [e.name for e in all_formats() if e.can_write]
READABLE = [e.name for e in all_formats() if e.can_read]
PRODUCER_FIXTURES = Path(__file__).parents[1] / "producer_fixtures"  # checkpoints the real producers made
# a value of each option kind that its parser takes
VALID_VALUE = {"size": "2G", "path": "imatrix.dat", "text": "x", "flag": True}


def _run_main(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _valid_value(spec) -> str:
    return spec.choices[0] if spec.kind == "choice" else VALID_VALUE[spec.kind]


def _squeezed(text: str) -> str:
    """Text without whitespace: click wraps help at spaces and hyphens."""
    return re.sub(r"\s+", "", text)


def _gptq(fx) -> Path:
    return fx["variants"]["v1_b4_g32_sym"]["ckpt"]


def test_the_registry_declares_the_gguf_options_and_every_target_a_type_vocabulary():
    declared = declared_options()
    assert {flag: owners for flag, (_, owners) in declared.items()} == {
        "--split-max-size": ("gguf",), "--imatrix": ("gguf",), "--quantizer": ("gguf",), "--no-mtp": ("gguf",),
        "--scale-dtype": ("mlx",)}
    assert declared["--quantizer"][0].choices == ("qconvert", "llama.cpp")
    for entry in all_formats():
        if entry.can_write:
            assert entry.type_help and entry.examples, entry.name
    assert "q4_k_m" in get_format("gguf").type_help and "afq4" in get_format("uqff").type_help


@pytest.mark.parametrize("entry", [e for e in all_formats() if e.options], ids=lambda e: e.name)
def test_a_declared_option_fills_its_options_extra_key(entry):
    for spec in entry.options:
        extra = cli.writer_extra(entry, {spec.flag: _valid_value(spec)})
        assert list(extra) == [spec.key]
    gguf = get_format("gguf")
    # the values the gguf writer reads, as the CLI has always passed them
    assert cli.writer_extra(gguf, {"--split-max-size": "2G", "--imatrix": Path("m/i.dat"), "--quantizer": "llama.cpp"}) \
        == {"split_max_size": 2_000_000_000, "imatrix": "m/i.dat", "quantizer": "llama.cpp"}
    assert cli.writer_extra(gguf, {"--split-max-size": None}) == {}
    assert cli.writer_extra(gguf, {"--no-mtp": True}) == {"no_mtp": True}  # a flag: on when given
    assert cli.writer_extra(gguf, {"--no-mtp": None}) == cli.writer_extra(gguf, {"--no-mtp": False}) == {}


@pytest.mark.parametrize("target", WRITABLE)
def test_an_option_the_target_does_not_declare_is_one_line_with_exit_2(fx, tmp_path, capsys, target):
    entry = get_format(target)
    refused = [(flag, spec, owners) for flag, (spec, owners) in declared_options().items() if target not in owners]
    if target == "gguf":
        assert [flag for flag, _, _ in refused] == ["--scale-dtype"]  # it declares every option but mlx's
    for flag, spec, owners in refused:
        out = tmp_path / f"out-{flag.strip('-')}"
        want = f"qconvert: error: {flag} applies to {' or '.join(owners)} output only (the target is {entry.name})"
        for command in ([f"gptq->{target}", _gptq(fx), out], ["convert", _gptq(fx), out, "--to", target]):
            given = [flag] if spec.kind == "flag" else [flag, _valid_value(spec)]  # a flag takes no value
            rc, stdout, err = _run_main(capsys, *command, *given)
            assert (rc, err.strip()) == (2, want) and stdout == ""
            assert not out.exists() and not [p for p in tmp_path.iterdir() if "qconvert-tmp" in p.name]


def test_split_max_size_reaches_the_gguf_writer(fx, tmp_path, capsys):
    out = tmp_path / "parts.gguf"
    rc, _, err = _run_main(capsys, "convert", _gptq(fx), out, "--to", "gguf", "--split-max-size", "100K", "--quiet")
    assert rc == 0, err
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert len(parts) > 1 and all(re.fullmatch(r"parts-\d{5}-of-\d{5}\.gguf", p) for p in parts), parts
    rc, _, err = _run_main(capsys, "gptq->gguf", _gptq(fx), tmp_path / "x.gguf", "--split-max-size", "2X")
    assert (rc, err.strip()) == (2, "qconvert: error: --split-max-size expects a size such as 500M or 2G, got '2X'")


def _down_proj_reasons(capsys, base: Path, tmp_path: Path, *options) -> dict[str, str]:
    """The plan's reasons for the two down_proj of the dense base model planned as Q4_K: the only weights
    of the 128-wide model whose 256-wide rows hold K blocks (the rest fall back to legacy types)."""
    report = tmp_path / "r.json"
    rc, _, err = _run_main(capsys, "hf->gguf", base, tmp_path / "o.gguf", "--type", "q4_k", "--allow-requant",
                           "--dry-run", "--report", report, *options)
    assert rc == 0, err
    reasons = {t["name"]: t["reason"] for t in json.loads(report.read_text())["tensors"]}
    return {i: reasons[f"model.layers.{i}.mlp.down_proj.weight"] for i in (0, 1)}


def test_imatrix_reaches_the_gguf_writer(fx, tmp_path, capsys):
    imatrix = tmp_path / "imatrix.dat"
    write_legacy_imatrix(imatrix, {"blk.0.ffn_down.weight": np.linspace(0.1, 4.0, 256, dtype=np.float32)})
    reasons = _down_proj_reasons(capsys, fx["bases"]["base"], tmp_path, "--imatrix", imatrix)
    assert "weighted by the imatrix" in reasons[0]
    assert "no imatrix entry" in reasons[1]
    assert "imatrix" not in _down_proj_reasons(capsys, fx["bases"]["base"], tmp_path)[0]


def test_quantizer_reaches_the_gguf_writer(fx, tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="--quantizer llama.cpp needs llama-cpp-python")
    reasons = _down_proj_reasons(capsys, fx["bases"]["base"], tmp_path, "--quantizer", "llama.cpp")
    assert "llama.cpp's quantizer" in reasons[0]
    assert "llama.cpp" not in _down_proj_reasons(capsys, fx["bases"]["base"], tmp_path, "--quantizer", "qconvert")[0]


def _normalized(text: str, *paths: Path) -> str:
    """Output with the run's own output path and timings taken out."""
    for i, p in enumerate(paths):
        text = text.replace(str(p), f"<OUT{i}>")
    return re.sub(r"\d+(\.\d+)? s\b", "<T> s", text)


@pytest.mark.parametrize("variant", ["v1_b4_g32_sym", "v2_b4_g32_sym"])
def test_convert_to_detects_the_source_and_equals_the_pair_command(fx, tmp_path, capsys, variant):
    src = fx["variants"][variant]["ckpt"]
    fmt = "gptq" if variant.startswith("v1") else "gptq-v2"
    pair, detected = tmp_path / "pair.gguf", tmp_path / "detected.gguf"
    rc, pair_out, pair_err = _run_main(capsys, f"{fmt}->gguf", src, pair, "--report", tmp_path / "pair.json")
    assert rc == 0, pair_err
    rc, out, err = _run_main(capsys, "convert", src, detected, "--to", "gguf", "--report", tmp_path / "det.json")
    assert rc == 0, err
    assert detected.read_bytes() == pair.read_bytes()
    assert _normalized(out, detected) == _normalized(pair_out, pair)
    assert err == pair_err + f"detected source format: {fmt}\n"
    reports = [json.loads((tmp_path / name).read_text()) for name in ("pair.json", "det.json")]
    for r in reports:
        r["target"]["path"] = None
        r["summary"].pop("seconds")
    assert reports[0] == reports[1]
    # --quiet keeps stderr for errors and warnings; --from reads as the format named, without detecting
    rc, out, err = _run_main(capsys, "convert", src, tmp_path / "q.gguf", "--to", "gguf", "--quiet")
    assert rc == 0 and "detected" not in err and len(out.splitlines()) == 1
    rc, out, err = _run_main(capsys, "convert", src, tmp_path / "f.gguf", "--from", fmt, "--to", "gguf")
    assert rc == 0 and "detected" not in err and (tmp_path / "f.gguf").read_bytes() == pair.read_bytes()


def test_convert_without_from_refuses_a_folder_no_format_claims(tmp_path, capsys):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a model")
    out = tmp_path / "o.gguf"
    rc, stdout, err = _run_main(capsys, "convert", folder, out, "--to", "gguf")
    assert rc == 2 and stdout == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"qconvert: error: {folder}: not a format qconvert reads: a folder without config.json")
    assert ", ".join(READABLE) in err
    assert not out.exists()


def test_convert_with_an_unknown_target_names_the_known_formats(fx, tmp_path, capsys):
    rc, _, err = _run_main(capsys, "convert", _gptq(fx), tmp_path / "o", "--to", "nope")
    known = ", ".join(e.name for e in all_formats())
    assert rc == 2 and err.strip() == f"qconvert: error: unknown format 'nope'; known formats: {known}"


def test_help_lists_every_pair_and_the_examples(capsys):
    rc, out, _ = _run_main(capsys, "--help")
    assert rc == 0
    pairs = out.split("Pairs (SRC->DST or SRC:DST):")[1].split("Examples:")[0]
    rows: dict[str, str] = {}
    for line in pairs.splitlines():  # a row whose targets wrap continues on lines indented further
        if line[:3].strip() and line.strip():
            name, targets = line.split(None, 1)
            rows[name] = targets.strip().removeprefix("->").strip()
        elif line.strip():
            rows[name] += " " + line.strip()
    assert rows == {name: ", ".join(WRITABLE) for name in READABLE}
    examples = [line.strip() for line in out.split("Examples:")[1].splitlines() if line.strip()]
    assert examples == [e.examples[0] for e in all_formats() if e.can_write]
    assert "convert" in out.split("Commands:")[1]


@pytest.mark.parametrize("target", WRITABLE)
def test_type_help_names_the_target_vocabulary_and_only_its_options(capsys, target):
    entry = get_format(target)
    for command in ([f"gptq->{target}"], ["convert", "--to", target]):
        rc, out, _ = _run_main(capsys, *command, "--help")
        assert rc == 0 and _squeezed(entry.type_help) in _squeezed(out)
        for flag, (_, owners) in declared_options().items():
            assert (flag in out) == (target in owners), (command, flag)
    rc, out, _ = _run_main(capsys, "convert", "--help")  # no target yet: every option is shown
    assert all(flag in out for flag in declared_options())


def _example_argv(example: str, sources: dict[str, Path], out: Path) -> list[str]:
    """An example command line with its source replaced by a fixture of the source's format (the pair's
    source, else the placeholder's suffix or name) and its output by `out`."""
    argv = shlex.split(example)
    assert argv[0] == "qconvert", example
    command, placeholder = argv[1], argv[2]
    fmt = command.split("->")[0] if "->" in command else ("gguf" if placeholder.endswith(".gguf") else
                                                           placeholder.split("-")[1].rstrip("/"))
    return [command, str(sources[get_format(fmt).name]), str(out), *argv[4:]]


def _by_path(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "support" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fp8_llama(fx, tmp_path: Path) -> Path:
    """The tiny llama in FP8 by transformers' own quantizer (tests/support/fixtures_float.py)."""
    return _by_path("fixtures_float").fp8_checkpoint(fx["bases"]["base"], tmp_path / "fp8", block=(16, 32),
                                                      rule="transformers")


def _gpt_oss_mxfp4(tmp_path: Path) -> Path:
    """The tiny gpt-oss in gpt-oss's MXFP4 checkpoint form (tests/support/fixtures_archs.py)."""
    fa = _by_path("fixtures_archs")
    return fa.gpt_oss_mxfp4_checkpoint(fa.build_arch_model(tmp_path / "gpt-oss", "gpt_oss"), tmp_path / "gpt-oss-mxfp4")


def test_every_example_runs_as_written(fx, tmp_path, capsys):
    """The examples --help shows and the registry holds are commands that succeed (without --allow-requant
    where they give none: their conversions are exact or near-exact)."""
    gguf_q4_0 = tmp_path / "src.gguf"
    assert _run_main(capsys, "gptq->gguf", _gptq(fx), gguf_q4_0, "--quiet")[0] == 0
    sources = {"gptq": fx["variants"]["v1_b4_gm1_sym"]["ckpt"], "hf": fx["bases"]["base"], "gguf": gguf_q4_0,
               "bitsandbytes": PRODUCER_FIXTURES / "bitsandbytes" / "int8",
               "compressed-tensors": PRODUCER_FIXTURES / "compressed_tensors" / "w4a16_g32_sym",
               "modelopt": PRODUCER_FIXTURES / "modelopt" / "mxfp4", "fp8": _fp8_llama(fx, tmp_path),
               "mxfp4": _gpt_oss_mxfp4(tmp_path), "torchao": PRODUCER_FIXTURES / "torchao" / "intx4_g32_sym",
               "quark": PRODUCER_FIXTURES / "quark" / "mxfp4"}
    ran = 0
    for entry in all_formats():
        for i, example in enumerate(entry.examples):
            out = tmp_path / f"{entry.name}-{i}" / ("out.gguf" if entry.name == "gguf" else "out")
            rc, _, err = _run_main(capsys, *_example_argv(example, sources, out), "--quiet")
            assert rc == 0, (example, err)
            assert out.exists() or list(out.parent.glob("out-*-of-*.gguf")), example
            ran += 1
    assert ran >= len(WRITABLE)
