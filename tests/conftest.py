"""pytest setup: support/ on sys.path (tests import `helpers`, `fixtures` and the other shared modules there),
the session's gptqmodel fixtures, and the switch that makes a missing oracle a failure.

`QCONVERT_REQUIRE_ORACLES=1` (set by scripts/run_tests.sh, hence by CI) turns every skip into a failure:
the tests skip only when an oracle (llama.cpp, gptqmodel, hqq, mistralrs, transformers, triton) is not
installed, and a run that proves nothing must not pass."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))
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


REQUIRE_ORACLES = os.environ.get("QCONVERT_REQUIRE_ORACLES", "") not in ("", "0")


def _as_failure(report) -> None:
    if REQUIRE_ORACLES and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = ("skipped, but QCONVERT_REQUIRE_ORACLES=1 makes a missing oracle a failure: "
                           f"{report.longrepr}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _as_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _as_failure(outcome.get_result())
