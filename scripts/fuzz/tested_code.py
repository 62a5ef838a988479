"""The code under test, and the only module of the fuzzer that imports qconvert: the hash of its source
(the key of the cached seed references), preload_qconvert (the parent, before any fork) and run_cli (a
child: `qconvert ARGV` as the console script runs it).
"""

from __future__ import annotations

import hashlib
import sys
import traceback

from .common import REPO

SUBPACKAGES = ("converters", "formats", "kernels")  # qconvert's code: hashed, and preloaded


def code_hash() -> str:
    h = hashlib.sha1()
    for sub in SUBPACKAGES:
        for p in sorted((REPO / sub).rglob("*.py")):
            h.update(p.relative_to(REPO).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def preload_qconvert() -> list[str]:
    """Import every module of qconvert here, once: the children inherit them (no torch op runs in this
    process) and never import qconvert code from disk, so a run tests one version of the code even while
    the working tree changes under it (a child importing a newer converters/run.py next to older modules
    would fail with ImportErrors that are not qconvert's). Returns the modules that could not be imported."""
    import importlib
    import pkgutil

    failed = []
    for sub in SUBPACKAGES:
        pkg = importlib.import_module(f"qconvert.{sub}")
        for info in pkgutil.walk_packages(pkg.__path__, f"qconvert.{sub}."):
            if "triton" in info.name:  # GPU kernels: never used on CPU, and importing triton is slow
                continue
            try:
                importlib.import_module(info.name)
            except Exception:
                failed.append(info.name)
    from qconvert.converters.class_tensors import preload
    from qconvert.converters.registry import all_formats

    all_formats()
    preload()  # transformers' model machinery, which the check of non-llama checkpoints asks (2-4 s a case)
    return failed


def run_cli(argv: list[str]) -> int:
    """`qconvert ARGV` in this (child) process: its exit status, an uncaught exception printed as the
    interpreter would (the import finds the module preload_qconvert loaded in the parent)."""
    from qconvert.converters.apps.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what the interpreter would print for an uncaught exception
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return rc
