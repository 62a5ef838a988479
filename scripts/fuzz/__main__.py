"""`python scripts/fuzz [options]`: run the fuzzer (cli.main; the package docstring says what it does).

Python runs a folder's __main__.py as a top-level script with the folder itself as sys.path[0]; the
folder is put back as the package `fuzz` imported from scripts/ (sys.path[0] is then what it was for the
single-file scripts/fuzz.py), so that its modules import each other as one package.
"""

import sys
from pathlib import Path

if not __package__:  # `python scripts/fuzz`
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))
    from fuzz.cli import main
else:  # `python -m fuzz` with scripts/ on the path
    from .cli import main

if __name__ == "__main__":
    sys.exit(main())
