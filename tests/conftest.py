"""pytest setup: this folder on sys.path (tests import `helpers` and `fixtures`), and the session's
gptqmodel fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import fixtures  # noqa: E402


@pytest.fixture(scope="session")
def fx():
    """The gptqmodel-made checkpoints and their references (built once, cached in tests/_fixtures)."""
    return fixtures.ensure_fixtures(fixtures.DEFAULT_ROOT)


@pytest.fixture(scope="session")
def prompt(fx):
    return list(fx["prompt_ids"])
