import sys

from .converters.apps.cli import main

sys.exit(main())
