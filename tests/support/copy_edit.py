"""Breaking a copy of a cached fixture: copying its folder (without the cache's markers) and rewriting one of its
safetensors files in place (tests/formats/hqq/test_bad_hqq.py, tests/formats/uqff/test_bad_uqff.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".done", "mistralrs_logprobs.json"))
    return dst


def _edit(path: Path, fn) -> None:
    """Rewrite one safetensors file (a .uqff shard or residual) after `fn` edits its tensors, keeping its
    metadata."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata=meta)
