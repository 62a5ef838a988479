"""The package as users install it: the wheel (and the sdist it can be built from) holds every subpackage
and nothing else, and a non-editable install in a fresh virtual environment outside the checkout lists the
seven formats and converts with each of them, through `python -m qconvert` and the `qconvert` script.

The fresh environment gets the third-party packages (torch, gguf, ...) of the test environment through a
.pth line that appends that site-packages folder to sys.path: site.py processes .pth files only in site
directories, not in folders a .pth line adds, so the editable install's finder there stays inactive and
`qconvert` can only come from the wheel (checked below, with `qconvert.__file__`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CODE_ROOTS = ("converters", "formats", "kernels")
FORMATS = {"gguf", "gptq", "gptq-v2", "hf", "hqq", "qqq", "uqff", "compressed-tensors", "mlx", "awq", "auto-round",
           "bitsandbytes", "fp8", "modelopt", "mxfp4", "torchao", "quark"}
PRODUCED = REPO / "tests" / "producer_fixtures"  # checkpoints the formats' own producers made
# never in a built distribution (the sdist holds only what builds the wheel, plus README and LICENSE)
NOT_SHIPPED = ("tests/", "scripts/", "examples/", ".venv", ".git/", "_fixtures", "__pycache__", ".pyc")


def _source_copy(dst: Path) -> Path:
    """The checkout without virtual environments, fixtures and build leftovers: an in-tree build would
    write build/ and egg-info into the checkout, and a stale build/lib can put removed modules in a wheel."""
    junk = shutil.ignore_patterns(".git", ".venv*", "_fixtures", "build", "dist", "*.egg-info", "__pycache__",
                                  ".pytest_cache", "*.pyc")
    shutil.copytree(REPO, dst, ignore=junk, symlinks=True)
    return dst


def _expected_modules() -> set[str]:
    """Every .py file of the package as the wheel must hold it: the root modules and every file under the
    code roots (each folder holding .py files is a subpackage)."""
    files = {f"qconvert/{p.name}" for p in REPO.glob("*.py") if p.name != "setup.py"}
    for root in CODE_ROOTS:
        for p in (REPO / root).rglob("*.py"):
            if "__pycache__" not in p.parts:
                files.add("qconvert/" + p.relative_to(REPO).as_posix())
    return files


def _packages_of(names) -> set[str]:
    return {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist and the wheel, both built from a copy of the checkout (no network: no build isolation)."""
    base = tmp_path_factory.mktemp("dist")
    src = _source_copy(base / "src")
    sdist_dir, wheel_dir = base / "sdist", base / "wheel"
    code = ("import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))")
    _run([sys.executable, "-c", code, sdist_dir], cwd=src)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheel_dir, "."], cwd=src)
    sdist, = sdist_dir.glob("qconvert-*.tar.gz")
    wheel, = wheel_dir.glob("qconvert-*.whl")
    return {"sdist": sdist, "wheel": wheel, "base": base}


def test_wheel_holds_every_subpackage_and_nothing_else(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    modules = {n for n in names if n.endswith(".py")}
    expected = _expected_modules()
    assert modules == expected, (sorted(expected - modules), sorted(modules - expected))
    folders_with_code = {"qconvert"} | {"qconvert/" + p.parent.relative_to(REPO).as_posix()
                                        for r in CODE_ROOTS for p in (REPO / r).rglob("*.py")
                                        if "__pycache__" not in p.parts}
    assert _packages_of(names) == folders_with_code
    assert "qconvert/formats/uqff" in folders_with_code  # the subpackage the hand-kept list dropped
    assert "qconvert/py.typed" in names
    dist_info = [n for n in names if ".dist-info/" in n]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in dist_info)
    data = [n for n in names if not n.endswith(".py") and ".dist-info/" not in n]
    # the bundled text `verify --logits` scores when no prompts are given; every C quantizer's source
    # (kernels/ggml/kquant_c.py and iq_c.py build them on first use; without them the wheel silently falls back
    # to the slower numpy paths)
    c_sources = sorted(f"qconvert/kernels/ggml/{p.name}" for p in (REPO / "kernels" / "ggml").glob("*.c"))
    assert {"qconvert/kernels/ggml/kquant_c.c", "qconvert/kernels/ggml/iq_c.c"} <= set(c_sources)
    assert sorted(data) == sorted(["qconvert/converters/apps/verify_text.txt", "qconvert/py.typed", *c_sources]), data
    assert not [n for n in names if any(bad in n for bad in NOT_SHIPPED)]
    meta = zipfile.ZipFile(built["wheel"]).read(next(n for n in dist_info if n.endswith("METADATA"))).decode()
    assert "License-Expression: MIT" in meta and "License-File: LICENSE" in meta
    entry_points = zipfile.ZipFile(built["wheel"]).read(
        next(n for n in dist_info if n.endswith("entry_points.txt"))).decode()
    assert "qconvert = qconvert.converters.apps.cli:console_main" in entry_points


def test_sdist_builds_the_same_wheel(built):
    with tarfile.open(built["sdist"]) as tar:
        members = [m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name]
        top = built["base"] / "from-sdist"
        tar.extractall(top, filter="data")
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "py.typed", "formats/uqff/reader.py"} <= set(members)
    assert not [m for m in members if any(bad in m for bad in NOT_SHIPPED)], members
    src, = top.iterdir()
    wheel_dir = built["base"] / "wheel-from-sdist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheel_dir, "."], cwd=src)
    again, = wheel_dir.glob("*.whl")
    assert sorted(zipfile.ZipFile(again).namelist()) == sorted(zipfile.ZipFile(built["wheel"]).namelist())


@pytest.fixture(scope="module")
def fresh(built, tmp_path_factory):
    """A virtual environment outside the checkout with the wheel installed (not editable)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", built["wheel"]])
    fresh_site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    main_site = Path(sysconfig.get_paths()["purelib"])
    (fresh_site / "zz_test_environment.pth").write_text(f"{main_site}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    cwd = venv.parent  # not the checkout: `python -m` puts the working directory first on sys.path
    return {"venv": venv, "py": py, "site": fresh_site, "main_site": main_site, "env": env, "cwd": cwd}


def _in_fresh(fresh, *args) -> subprocess.CompletedProcess:
    return _run([*args], env=fresh["env"], cwd=fresh["cwd"])


def test_fresh_venv_imports_the_wheel_not_the_checkout(fresh):
    probe = ("import json, sys, qconvert, qconvert.formats.uqff.reader as u; "
             "print(json.dumps({'file': qconvert.__file__, 'uqff': u.__file__, 'path': sys.path, "
             "'editable': [m for m in sys.modules if 'editable' in m], "
             "'finders': [type(f).__name__ for f in sys.meta_path]}))")
    info = json.loads(_in_fresh(fresh, fresh["py"], "-c", probe).stdout)
    venv = fresh["venv"].resolve()
    assert Path(info["file"]).resolve().is_relative_to(venv), info["file"]
    assert Path(info["uqff"]).resolve().is_relative_to(venv)
    assert not Path(info["file"]).resolve().is_relative_to(REPO)
    assert str(fresh["main_site"]) in info["path"]  # third-party packages come from the test environment
    assert not info["editable"] and not [f for f in info["finders"] if "Editable" in f], info
    assert (Path(info["file"]).parent / "py.typed").is_file()
    text = _in_fresh(fresh, fresh["py"], "-c", "from qconvert.converters.apps.logits import bundled_text; "
                                               "print(bundled_text().split()[:3])").stdout
    assert text.strip() == "['The', 'river', 'town']"  # verify --logits' default text, read from the wheel


def test_fresh_venv_lists_and_converts_every_format(fresh, fx, tmp_path):
    py, script = fresh["py"], fresh["venv"] / "bin" / "qconvert"
    listed = {line.split()[0] for line in _in_fresh(fresh, script, "formats").stdout.splitlines() if line.strip()}
    assert listed == FORMATS
    listed_m = {line.split()[0] for line in _in_fresh(fresh, py, "-m", "qconvert", "formats").stdout.splitlines()
                if line.strip()}
    assert listed_m == FORMATS
    g128 = fx["variants"]["v1_b4_g128_sym"]["ckpt"]
    per_channel = fx["variants"]["v1_b4_gm1_sym"]["ckpt"]
    t = tmp_path
    # each format written at least once and read at least once, through both entry points
    steps = [
        (script, "gptq->gguf", g128, t / "a.gguf"),           # read gptq, write gguf
        (py, "gptq->gptq-v2", g128, t / "v2"),                # write gptq-v2
        (script, "gptq-v2->hqq", t / "v2", t / "hqq"),        # read gptq-v2, write hqq
        (py, "hqq->uqff", t / "hqq", t / "uqff"),             # read hqq, write uqff
        (script, "uqff->hf", t / "uqff", t / "hf"),           # read uqff, write hf
        (py, "gptq->qqq", per_channel, t / "qqq"),            # write qqq
        (script, "qqq->gptq", t / "qqq", t / "gptq"),         # read qqq, write gptq
        (py, "gguf->hf", t / "a.gguf", t / "hf2"),            # read gguf
        (script, "hf->gguf", t / "hf2", t / "b.gguf", "--type", "f32"),  # read hf
        (py, "gptq->compressed-tensors", g128, t / "ct"),     # write compressed-tensors
        (script, "compressed-tensors->mlx", t / "ct", t / "mlx"),  # read compressed-tensors, write mlx
        (py, "mlx->gguf", t / "mlx", t / "c.gguf"),           # read mlx
        (script, "awq->gptq-v2", PRODUCED / "awq" / "gemm_g32", t / "awq"),  # read awq
        (py, "auto-round->gguf", PRODUCED / "auto_round" / "sym4_g32", t / "ar.gguf"),  # read auto-round
        (script, "bnb->hf", PRODUCED / "bitsandbytes" / "nf4_dq", t / "bnb"),  # read bitsandbytes
        (py, "modelopt->gguf", PRODUCED / "modelopt" / "nvfp4", t / "nvfp4.gguf"),  # read modelopt, NVFP4 blocks
        (script, "gguf->uqff", t / "mx.gguf", t / "mx-uqff"),  # read gguf MXFP4, write uqff mxfp4
        (py, "fp8->hf", t / "fp8", t / "fp8-hf"),             # read fp8 (made below from a checkpoint here)
        (script, "torchao->gguf", PRODUCED / "torchao" / "intx4_g32_sym", t / "ao.gguf"),  # read torchao
        (py, "quark->fp8", PRODUCED / "quark" / "mxfp4", t / "quark-fp8"),  # read quark, write fp8
    ]
    steps.append((script, "mxfp4->gguf", t / "gpt-oss-mxfp4", t / "gpt-oss.gguf"))  # read gpt-oss MXFP4
    import fixtures
    import fixtures_archs
    import fixtures_float

    fixtures_float.fp8_checkpoint(fixtures.ensure_base(fixtures.DEFAULT_ROOT, "base"), t / "fp8", block=(16, 32),
                                  rule="transformers")
    fixtures_archs.gpt_oss_mxfp4_checkpoint(fixtures_archs.build_arch_model(t / "gpt-oss", "gpt_oss"),
                                            t / "gpt-oss-mxfp4")
    _in_fresh(fresh, script, "modelopt->gguf", PRODUCED / "modelopt" / "mxfp4", t / "mx.gguf", "--quiet")
    for entry, *args in steps:
        cmd = [entry] if entry == script else [py, "-m", "qconvert"]
        _in_fresh(fresh, *cmd, *args, "--quiet")
        assert Path(args[2]).exists(), args
    # the installed package writes what the checkout writes
    from qconvert.converters.plan import Options
    from qconvert.converters.run import convert

    convert("gptq", g128, "gguf", t / "checkout.gguf", Options(), progress=False)
    assert (t / "checkout.gguf").read_bytes() == (t / "a.gguf").read_bytes()
