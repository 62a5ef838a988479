"""hqq"""

from . import reader  # noqa: F401  (registers the format)
