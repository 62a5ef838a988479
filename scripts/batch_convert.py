#!/usr/bin/env python
"""Batch conversion from a manifest: a thin wrapper of `qconvert batch` (converters/apps/batch.py).

    python scripts/batch_convert.py MANIFEST [--workers N] [--report DIR] [--dry-run] [--force] [--ray [ADDRESS]]
"""

import sys

from qconvert.converters.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
