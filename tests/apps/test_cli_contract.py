"""The command line's promises around failure: one line for every error (exit 2 for bad input, 1 for a bug),
no warning before it, advice that names commands and types that exist and succeed, no temporary left
behind by a killed run."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from helpers import expect_user_error, run_cli
from hqq_env import hqq_root  # noqa: F401  (the HQQ fixtures, built on first use)
from synthetic_gptq import make_synthetic_gptq

from qconvert.converters.apps import cli
from qconvert.converters.registry import all_formats
from qconvert.converters.output import _HOST, remove_stale_temporaries
from qconvert.formats import gptq

ALIGNED = re.compile(r"aligned choice: (.+?)(?:; pass --allow-requant|$)")


def _run_main(capsys, *args) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_a_bug_is_one_line_naming_the_input_with_exit_1(fx, tmp_path, capsys, monkeypatch):
    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"]

    def broken(self):
        raise ZeroDivisionError("division by zero")
        yield  # pragma: no cover

    monkeypatch.setattr(gptq.GptqSource, "records", broken)
    rc, out, err = _run_main(capsys, "gptq->gguf", src, tmp_path / "o.gguf")
    assert rc == 1
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"qconvert: error: {src}: unexpected ZeroDivisionError (division by zero)")
    assert "--debug" in err and "report" in err
    assert not list(tmp_path.iterdir())

    rc, out, err = _run_main(capsys, "gptq->gguf", src, tmp_path / "o.gguf", "--debug")
    assert rc == 1 and "Traceback" in err and "ZeroDivisionError" in err


@pytest.mark.parametrize("failure", ["enospc", "short write"])
def test_a_full_disk_is_one_line_saying_so_not_a_bug(fx, tmp_path, capsys, monkeypatch, failure):
    """A write the disk cannot hold (ENOSPC from the OS, or numpy's errno-less "N requested and M written" short
    write, which a full disk gave the GGUF writer in this stop's benchmark) is one line saying the disk is full,
    exit 1, nothing at the destination; it used to be reported as "unexpected OSError ...; this is a bug"."""
    import errno

    from qconvert.formats.gguf.writer import GgufSession

    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    calls = {"n": 0}
    real = GgufSession._write

    def fills_up(self, plan, data):
        calls["n"] += 1
        if calls["n"] == 3:
            if failure == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "o.gguf"))
            raise OSError("13762560 requested and 3329824 written")
        return real(self, plan, data)

    monkeypatch.setattr(GgufSession, "_write", fills_up)
    rc, out, err = _run_main(capsys, "gptq->gguf", src, tmp_path / "o.gguf")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("qconvert: error: ") and "bug" not in err, err
    assert ("no space left on device" in err) if failure == "enospc" else ("the disk is probably full" in err), err
    assert "nothing was left at the destination" in err
    assert not list(tmp_path.iterdir())


def test_warnings_never_precede_the_error_line(fx, tmp_path, capsys, monkeypatch):
    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"]
    real_init = gptq.GptqSource.__init__

    def noisy(self, *a, **k):
        warnings.warn("a library's warning", UserWarning)
        logging.getLogger("gguf.some_library").warning("a library's log warning")
        real_init(self, *a, **k)

    monkeypatch.setattr(gptq.GptqSource, "__init__", noisy)
    # a refused plan: the error line alone
    rc, out, err = _run_main(capsys, "gptq->gguf", fx["variants"]["v1_b3_g32_sym"]["ckpt"], tmp_path / "o.gguf")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("qconvert: error: refused:"), err
    # a success: the held warnings follow the output, once each
    rc, out, err = _run_main(capsys, "gptq->gguf", src, tmp_path / "ok.gguf", "--quiet")
    assert rc == 0 and out.strip().endswith(str(tmp_path / "ok.gguf"))
    assert err.splitlines() == ["qconvert: warning: a library's warning",
                                "qconvert: warning: a library's log warning"]


def test_unknown_data_is_described_and_the_supported_formats_named(fx, tmp_path):
    folder = tmp_path / "ct"
    shutil.copytree(fx["variants"]["v1_b4_g32_sym"]["ckpt"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "eetq", "format": "w8a16"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "quantize_config.json").unlink()
    proc = run_cli("inspect", folder, check_rc=2)
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "--format" not in line
    assert "quant_method 'eetq'" in line and "format 'w8a16'" in line
    assert ", ".join(e.name for e in all_formats() if e.can_read) in line
    err = expect_user_error("hf->gguf", folder, tmp_path, "config.json", "quant_method 'eetq'",
                            "does not read yet", out_name="o.gguf")
    assert "eetq->" not in err
    # a quantized folder qconvert does read: the advice names a pair that works
    err = expect_user_error("hf->gguf", fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path, "read it as gptq",
                            out_name="o.gguf")
    run_cli("gptq->gguf", fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path / "works.gguf")


def _follow_advice(pair: str, src: Path, out: Path, args: list[str], err: str) -> list[str]:
    """Every aligned choice a refusal proposes, re-run as a command: each must succeed."""
    m = ALIGNED.search(err)
    assert m, err
    ran = []
    for choice in m[1].split(" / "):
        cmd = re.search(r"qconvert '([^']+)'(.*)$", choice)
        if cmd:  # a whole command: another pair (and options)
            new_pair = cmd[1].replace("SRC", pair.split("->")[0])
            extra = re.sub(r"\(.*?\)", "", cmd[2]).split()
            run_cli(new_pair, src, out.with_name(out.name + f".{len(ran)}"), *extra)
        elif choice.startswith("no --type"):  # the same command without its --type
            kept = [a for i, a in enumerate(args) if a != "--type" and (i == 0 or args[i - 1] != "--type")]
            run_cli(pair, src, out.with_name(out.name + f".{len(ran)}"), *kept)
        else:
            opts = re.sub(r"\(.*?\)", "", choice).split()
            assert opts and opts[0].startswith("--"), choice
            run_cli(pair, src, out.with_name(out.name + f".{len(ran)}"), *opts)
        ran.append(choice)
    return ran


def test_refusals_propose_only_choices_that_succeed(fx, tmp_path):
    cases = [
        ("gptq->gguf", fx["variants"]["v1_b3_g32_sym"]["ckpt"], []),            # 3-bit: --type q4_0 (exact)
        ("gptq->gguf", fx["variants"]["v1_b4_g32_sym_act"]["ckpt"], []),        # act-order scattering blocks
        ("gptq-v2->gptq", fx["variants"]["v2_b4_g32_asym_zp0"]["ckpt"], []),    # asym into v1: gptq-v2
        ("gptq->gptq", fx["variants"]["v1_b4_g32_sym"]["ckpt"], ["--type", "4g32a"]),  # asked asym v1
        ("gptq->gptq-v2", fx["variants"]["v1_b8_g128_sym"]["ckpt"], ["--type", "4g128"]),  # type differs
    ]
    proposed = []
    for i, (pair, src, args) in enumerate(cases):
        out = tmp_path / f"case{i}"
        proc = run_cli(pair, src, out, *args, check_rc=2)
        err = proc.stderr.strip()
        assert len(err.splitlines()) == 1 and not out.exists(), err
        proposed += _follow_advice(pair, src, out, args, err)
    assert len(proposed) >= len(cases)


def test_stale_temporaries_of_dead_runs_are_removed(fx, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.gguf.qconvert-tmp-{_HOST}-{dead.pid}"
    stale.write_bytes(b"x" * 1000)
    stale_dir = tmp_path / f".other.qconvert-tmp-{_HOST}-{dead.pid}"
    (stale_dir / "sub").mkdir(parents=True)
    live = tmp_path / f".out.gguf.qconvert-tmp-{_HOST}-{os.getpid()}"  # this test process is alive
    live.write_bytes(b"y")
    foreign = tmp_path / f".out.gguf.qconvert-tmp-otherhost-{dead.pid}"  # another machine's, on a shared disk
    foreign.write_bytes(b"z")
    unrelated = tmp_path / ".keep.me"
    unrelated.write_bytes(b"k")
    run_cli("gptq->gguf", fx["variants"]["v1_b4_g32_sym"]["ckpt"], tmp_path / "out.gguf")
    assert not stale.exists() and not stale_dir.exists()
    assert live.exists() and foreign.exists() and unrelated.exists()
    assert remove_stale_temporaries(tmp_path) == []  # nothing more to remove


def test_kill_9_during_a_write_then_a_rerun_completes(tmp_path):
    src = tmp_path / "src"
    make_synthetic_gptq(src, hidden=1024, intermediate=2816, layers=12, shard_mb=48)
    clean = tmp_path / "clean.gguf"
    run_cli("gptq->gguf", src, clean)

    work = tmp_path / "work"
    work.mkdir()
    out = work / "out.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "qconvert", "gptq->gguf", str(src), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    temp = None
    while time.monotonic() < deadline and proc.poll() is None:
        temps = [p for p in work.iterdir() if "qconvert-tmp" in p.name]
        if temps and temps[0].stat().st_size > 1_000_000:  # the writer is under way
            temp = temps[0]
            break
        time.sleep(0.02)
    assert temp is not None, "the conversion finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and temp.exists()  # killed: no output, its temporary left behind

    run_cli("gptq->gguf", src, out)
    assert out.read_bytes() == clean.read_bytes()
    assert sorted(p.name for p in work.iterdir()) == ["out.gguf"]


@pytest.mark.parametrize("fixture", ["gptq", "hqq"])
def test_quantization_config_that_is_no_object(fx, tmp_path, fixture, request):
    """Detection (inspect) and the named reader both refuse it in one line; neither crashes on it."""
    # the HQQ fixtures are asked for (built on first use), not assumed built by a test that ran earlier
    src = fx["variants"]["v1_b4_g32_sym"]["ckpt"] if fixture == "gptq" else \
        request.getfixturevalue("hqq_root") / "b4_g64_ax1" / "tf"
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = "-inf"
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "quantize_config.json").unlink(missing_ok=True)
    proc = run_cli("inspect", folder, check_rc=2)
    assert len(proc.stderr.strip().splitlines()) == 1 and "quantization_config is not a JSON object" in proc.stderr
    expect_user_error(f"{fixture}->hf", folder, tmp_path, "config.json", "quantization_config is '-inf'")


def test_error_lines_stay_one_printable_line():
    """Names read from a damaged file (a GGUF key whose length field was edited, a tensor name) can hold
    newlines, NULs and terminal escapes: the message shows them escaped, on one line, bounded."""
    from qconvert.converters.errors import BadInput

    e = BadInput("metadata \x00tokenizer.ggml.pre\x08\n\x1b[31m", path="/m/model.gguf", tensor="t\nx")
    line = str(e)
    assert line.isprintable() and "\n" not in line
    assert line == "/m/model.gguf, tensor t\\nx: metadata \\x00tokenizer.ggml.pre\\x08\\n\\x1b[31m"
    assert len(str(BadInput("k" * 10**6, path="/m/x"))) <= 2000


def test_special_token_ids_outside_the_vocabulary_are_skipped_with_a_warning_naming_the_folder(fx, tmp_path, capsys):
    """As llama.cpp's converter does (gguf-py's SpecialVocab skips them): a pad id equal to the vocabulary size
    is common in real configs, so this is no refusal, but the warning names the folder and the id."""
    import gguf

    src = tmp_path / "model"
    shutil.copytree(fx["bases"]["base"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["bos_token_id"] = 2**31
    (src / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _run_main(capsys, "hf->gguf", src, tmp_path / "o.gguf", "--type", "f16", "--quiet")
    assert rc == 0, err
    assert err.splitlines() == [f"qconvert: warning: {src}: bos token id 2147483648 (config.json / "
                                f"tokenizer_config.json) is outside the {cfg['vocab_size']}-token vocabulary; "
                                "not written"]
    field = gguf.GGUFReader(tmp_path / "o.gguf").fields.get("tokenizer.ggml.bos_token_id")
    # the tokenizer files' own BOS (tokenizer_config.json's bos_token) is what remains, as in llama.cpp
    assert field is None or int(field.parts[field.data[0]][0]) < cfg["vocab_size"]
