#!/usr/bin/env python
"""Build the offline test fixtures (tiny model + gptqmodel GPTQ checkpoints + gptqmodel references).

    python scripts/make_fixtures.py [--root DIR] [--only NAME ...] [--list]
    python scripts/make_fixtures.py --bundled examples/tiny-llama-gptq-4bit

Thin CLI over tests/support/fixtures.py (all logic lives there so the tests can load it by path).
Needs the `gptq` and `test` extras (gptqmodel 7.6.0, transformers, tokenizers); CPU only, no network.
"""
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

_FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "support" / "fixtures.py"


def _load_fixtures():
    spec = importlib.util.spec_from_file_location("qconvert_test_fixtures", _FIXTURES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    sys.exit(_load_fixtures().main())
