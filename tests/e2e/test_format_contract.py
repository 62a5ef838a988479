"""One contract every registered format keeps, checked the same way for each (a new format module is
picked up from the registry with no list to edit here, but must add its row to TARGET_ARGS to pass):

- write: a tiny dense llama checkpoint converts into it through the CLI, and the JSON report (--report)
  accounts for every source tensor with a verdict and the measured error;
- read back: the format's own reader yields every source tensor under its Hugging Face name and shape,
  decoding to the values whose error the report gave;
- damage: with its largest file truncated to half, `qconvert inspect` and a conversion from it each exit
  2 with one `qconvert: error:` line naming that file, and the conversion leaves nothing at its output.

A format that only writes gets the first part; one that only reads gets the other two, from a sample
made by READ_ONLY_SAMPLES: the format's real producer (scripts/producers/) run on the dense source."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fixtures
from qconvert.converters.apps import cli
from qconvert.converters.registry import FormatEntry, all_formats, get_format

# Per target format, the conversion arguments a dense fp16 source needs: a --type its writer accepts
# for every tensor of the tiny llama, and --allow-requant where that type quantizes (lossy by design).
TARGET_ARGS: dict[str, list[str]] = {
    "gguf": ["--type", "q8_0", "--allow-requant"],
    "gptq": ["--type", "4g128", "--allow-requant"],
    "gptq-v2": ["--type", "4g128", "--allow-requant"],
    "hf": ["--type", "f16"],
    "hqq": ["--type", "4g64", "--allow-requant"],
    "qqq": ["--type", "g128", "--allow-requant"],
    "uqff": ["--type", "q8_0", "--allow-requant"],
    "compressed-tensors": ["--type", "4g128", "--allow-requant"],
    "mlx": ["--type", "mlx4g64", "--allow-requant"],
    "fp8": ["--type", "fp8", "--allow-requant"],
}

PRODUCERS = Path(__file__).resolve().parents[2] / "scripts" / "producers"


def _producer(script: str, *args) -> None:
    """Run a producer script in a child process: gptqmodel and auto-round patch transformers where they load."""
    subprocess.run([sys.executable, str(PRODUCERS / script), *map(str, args)], check=True, capture_output=True,
                   timeout=900)


def _awq_sample(dense: Path, tmp: Path) -> Path:
    _producer("awq.py", "--quantize", dense, tmp / "awq")  # gptqmodel 7.6's AWQ (GEMM, g128)
    return tmp / "awq"


def _auto_round_sample(dense: Path, tmp: Path) -> Path:
    _producer("auto_round.py", tmp / "auto-round", "sample", dense)  # auto-round 0.16, 4-bit sym g32
    return tmp / "auto-round"


def _bitsandbytes_sample(dense: Path, tmp: Path) -> Path:
    _producer("bitsandbytes.py", "--sample", dense, tmp / "bnb")  # transformers + bitsandbytes 0.50, NF4
    return tmp / "bnb"


def _load_by_path(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _modelopt_sample(dense: Path, tmp: Path) -> tuple[Path, Path]:
    """ModelOpt's NVFP4 export (tests/producer_fixtures/modelopt/nvfp4, made on CPU by scripts/producers/modelopt.py
    from a base it rebuilds here: the tiny llama, seed 1234, one layer), and that base as the source."""
    producer = _load_by_path("modelopt_producer", PRODUCERS / "modelopt.py")
    base = producer.build_base(tmp / "modelopt-base")
    sample = tmp / "modelopt"
    shutil.copytree(Path(__file__).parents[1] / "producer_fixtures" / "modelopt" / "nvfp4", sample,
                    ignore=shutil.ignore_patterns("oracle.json"))
    return sample, base


def _mxfp4_sample(dense: Path, tmp: Path) -> tuple[Path, Path]:
    """gpt-oss's MXFP4 form of the tiny gpt-oss (tests/support/fixtures_archs.py), and as its source the same model with
    every fused expert tensor split into the per-expert [out, in] weights the reader names (gate_up's rows
    alternate gate and up)."""
    from safetensors.torch import load_file, save_file

    fa = _load_by_path("fixtures_archs", Path(__file__).parents[1] / "support" / "fixtures_archs.py")
    gpt_oss = fa.build_arch_model(tmp / "gpt-oss", "gpt_oss")
    sample = fa.gpt_oss_mxfp4_checkpoint(gpt_oss, tmp / "mxfp4")
    split = {}
    for name, t in load_file(str(gpt_oss / "model.safetensors")).items():
        head, _, what = name.rpartition(".")
        if what in ("gate_up_proj", "down_proj") and head.endswith(".experts"):
            for e, w in enumerate(t.transpose(1, 2)):  # [E, in, out] -> per expert [out, in]
                parts = {"down_proj": w} if what == "down_proj" else {"gate_proj": w[0::2], "up_proj": w[1::2]}
                split.update({f"{head}.{e}.{p}.weight": x.contiguous() for p, x in parts.items()})
        else:
            split[name] = t
    source = tmp / "mxfp4-source"
    source.mkdir()
    save_file(split, str(source / "model.safetensors"))
    return sample, source


# Per format that reads but cannot write: a function (source folder, destination folder) -> a sample of it, or
# (sample, the dense folder it stands for) when the sample is not made from the shared dense source.
def _torchao_sample(dense: Path, tmp: Path) -> tuple[Path, Path]:
    """torchao's IntxWeightOnlyConfig (int4, groups of 32, symmetric) saved by transformers
    (tests/producer_fixtures/torchao/intx4_g32_sym, made on CPU by scripts/producers/torchao.py from the base it
    rebuilds here), and that base as the source."""
    producer = _load_by_path("torchao_producer", PRODUCERS / "torchao.py")
    base = producer.build_base(tmp / "torchao-base")
    sample = tmp / "torchao"
    shutil.copytree(Path(__file__).parents[1] / "producer_fixtures" / "torchao" / "intx4_g32_sym", sample,
                    ignore=shutil.ignore_patterns("oracle.json"))
    return sample, base


def _quark_sample(dense: Path, tmp: Path) -> tuple[Path, Path]:
    """AMD Quark's OCP MXFP4 export (tests/producer_fixtures/quark/mxfp4, made on CPU by scripts/producers/quark.py
    with amd-quark 0.13 from the base it rebuilds here), and that base as the source."""
    producer = _load_by_path("quark_producer", PRODUCERS / "quark.py")
    base = producer.build_base(tmp / "quark-base")
    sample = tmp / "quark"
    shutil.copytree(Path(__file__).parents[1] / "producer_fixtures" / "quark" / "mxfp4", sample,
                    ignore=shutil.ignore_patterns("oracle.json"))
    return sample, base


READ_ONLY_SAMPLES: dict = {"awq": _awq_sample, "auto-round": _auto_round_sample, "bitsandbytes": _bitsandbytes_sample,
                           "modelopt": _modelopt_sample, "mxfp4": _mxfp4_sample,
                           "torchao": _torchao_sample, "quark": _quark_sample}

VERDICTS = {"exact", "near-exact", "requantize"}  # "refused" never reaches a written output


def _formats() -> list[str]:
    return [e.name for e in all_formats()]


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory) -> Path:
    """A dense fp16 LlamaForCausalLM folder (config.json, model.safetensors, tokenizer files)."""
    base = fixtures.ensure_base(fixtures.DEFAULT_ROOT, "base")
    folder = tmp_path_factory.mktemp("contract") / "dense"
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns(".done"))
    return folder


def source_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The source's tensors as safetensors itself reads them (no qconvert code in between)."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    assert tensors, f"no tensors in {folder}"
    return tensors


def run_main(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def output_path(entry: FormatEntry, folder: Path) -> Path:
    return folder / (f"model.{entry.name}" if entry.writer.output_is_file else f"model-{entry.name}")


def write_half(entry: FormatEntry, source: Path, tmp_path: Path, capsys) -> tuple[Path, dict]:
    """Convert the dense source into `entry`; check the report; return the output and the report."""
    assert entry.name in TARGET_ARGS, (
        f"format {entry.name!r} writes, but tests/e2e/test_format_contract.py's TARGET_ARGS has no row for it: add "
        "the --type (and --allow-requant if that type is lossy) its writer takes for a dense fp16 llama")
    out = output_path(entry, tmp_path)
    report_path = tmp_path / "report.json"
    rc, stdout, stderr = run_main(capsys, f"hf->{entry.name}", source, out, *TARGET_ARGS[entry.name],
                                  "--quiet", "--report", report_path)
    assert rc == 0, f"hf->{entry.name} exited {rc}:\n{stdout}\n{stderr}"
    assert out.exists(), f"hf->{entry.name} reported success but wrote nothing at {out}"
    assert not [p.name for p in tmp_path.iterdir() if "qconvert-tmp" in p.name]
    report = json.loads(report_path.read_text())
    check_report(report, entry, source, out)
    return out, report


def check_report(report: dict, entry: FormatEntry, source: Path, out: Path) -> None:
    assert report["source"]["format"] == "hf" and report["source"]["path"] == str(source)
    assert report["target"] == {"format": entry.name, "path": str(out)}
    expected = {name: tuple(t.shape) for name, t in source_tensors(source).items()}
    rows = report["tensors"]
    assert sorted(r["name"] for r in rows) == sorted(expected), "the report must list every source tensor once"
    for r in rows:
        where = f"{entry.name} report, tensor {r['name']}"
        assert tuple(r["shape"]) == expected[r["name"]], where
        assert r["verdict"] in VERDICTS, (where, r["verdict"])
        assert isinstance(r["out_name"], str) and r["out_name"], where
        assert isinstance(r["source"], str) and r["source"] and isinstance(r["target"], str) and r["target"], where
        for key in ("max_abs_err", "rmse"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0.0, (where, key, r[key])
        assert r["rmse"] <= r["max_abs_err"], where
        if r["verdict"] == "exact":
            assert r["max_abs_err"] == 0.0, where
        if r["verdict"] == "requantize":
            assert r["reason"], f"{where}: a requantized tensor must say why"
    summary = report["summary"]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("exact", "near-exact", "requantize", "refused")}
    assert summary["tensors"] == len(rows)
    assert summary["verdicts"] == counts
    assert summary["max_abs_err"] == max(r["max_abs_err"] for r in rows)
    assert summary["dry_run"] is False and summary["seconds"] >= 0


def read_half(entry: FormatEntry, out: Path, source: Path, report: dict | None) -> None:
    """The format's own reader yields every source tensor by its HF name and shape; where a report is
    given, each decodes to values whose max error against the source is the one the report gave."""
    reader = entry.open_reader(out)
    records = {rec.name: rec for rec in reader.records()}
    expected = source_tensors(source)
    missing = sorted(set(expected) - set(records))
    assert not missing, f"{entry.name} reader of {out}: source tensors missing: {missing}"
    wrong = {n: (tuple(records[n].shape), tuple(t.shape)) for n, t in expected.items()
             if tuple(records[n].shape) != tuple(t.shape)}
    assert not wrong, f"{entry.name} reader of {out}: shapes (read, source) differ: {wrong}"
    if report is None:
        return
    claimed = {r["name"]: r["max_abs_err"] for r in report["tensors"]}
    for name, tensor in expected.items():
        read_back = records[name].load().dequantize(torch.float32)
        measured = float((read_back - tensor.to(torch.float32)).abs().max())
        assert math.isclose(measured, claimed[name], rel_tol=1e-6, abs_tol=1e-9), (
            f"{entry.name}: tensor {name} read back from {out} has max error {measured!r}, the report says "
            f"{claimed[name]!r}")


def largest_file(path: Path) -> Path:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def truncated_copy(out: Path, folder: Path) -> tuple[Path, Path]:
    """A copy of `out` (a file or a folder) in `folder` with its largest file cut to half its size."""
    copy = folder / f"truncated-{out.name}"
    if out.is_dir():
        shutil.copytree(out, copy)
    else:
        shutil.copy2(out, copy)
    victim = largest_file(copy)
    os.truncate(victim, victim.stat().st_size // 2)
    return copy, victim


def check_one_error_line(what: str, rc: int, stderr: str, victim: Path) -> None:
    lines = stderr.splitlines()
    assert rc == 2, f"{what}: exit {rc}, wanted 2; stderr:\n{stderr}"
    assert len(lines) == 1 and lines[0].startswith("qconvert: error:"), f"{what}: stderr is not one error line:\n{stderr}"
    assert str(victim) in lines[0], f"{what}: the error does not name the truncated file {victim}: {lines[0]}"


def damage_half(entry: FormatEntry, out: Path, tmp_path: Path, capsys) -> None:
    copy, victim = truncated_copy(out, tmp_path)
    rc, _, stderr = run_main(capsys, "inspect", copy)
    check_one_error_line(f"qconvert inspect {copy}", rc, stderr, victim)

    out2 = tmp_path / "from-truncated"
    rc, _, stderr = run_main(capsys, f"{entry.name}->hf", copy, out2)
    check_one_error_line(f"qconvert '{entry.name}->hf' {copy}", rc, stderr, victim)
    assert not out2.exists(), f"a failed {entry.name}->hf left {out2}"
    assert not [p.name for p in tmp_path.iterdir() if "qconvert-tmp" in p.name]


@pytest.mark.parametrize("fmt", _formats())
def test_format_contract(fmt, dense_source, tmp_path, capsys):
    entry = get_format(fmt)
    assert entry.can_read or entry.can_write, f"format {fmt!r} neither reads nor writes"
    report = None
    if entry.can_write:
        sample, report = write_half(entry, dense_source, tmp_path, capsys)
    else:
        assert fmt in READ_ONLY_SAMPLES, (
            f"format {fmt!r} only reads: add a function making a sample of it from the dense source to "
            "tests/e2e/test_format_contract.py's READ_ONLY_SAMPLES")
        sample = READ_ONLY_SAMPLES[fmt](dense_source, tmp_path)
        if isinstance(sample, tuple):
            sample, dense_source = sample
        capsys.readouterr()  # what building the sample printed (transformers' progress bars) is not the CLI's
    if not entry.can_read:
        return  # a write-only format: nothing can read its output back here
    read_half(entry, sample, dense_source, report)
    damage_half(entry, sample, tmp_path, capsys)
