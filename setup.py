"""The package list, computed: setuptools' own discovery cannot put the repository's folders under the
`qconvert` prefix (the repository root is the package, `package-dir = {"qconvert" = "."}` in
pyproject.toml), and a list kept by hand once left out `qconvert.formats.uqff`.

Every folder under the code roots that holds a `.py` file is a package; nothing else (tests/, scripts/,
examples/, virtual environments, fixtures) is. Everything else about the build is in pyproject.toml.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

CODE_ROOTS = ("converters", "formats", "kernels")


def qconvert_packages(here: str) -> list:
    packages = ["qconvert"]
    for root in CODE_ROOTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(here, root)):
            dirnames[:] = sorted(d for d in dirnames if d.isidentifier() and d != "__pycache__")  # no .x, a-b
            if any(f.endswith(".py") for f in filenames):
                packages.append("qconvert." + os.path.relpath(dirpath, here).replace(os.sep, "."))
    return packages


class BuildPy(build_py):
    """The root folder is the package `qconvert`, and this file lies in it: it is no module of qconvert."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "qconvert" and m[1] == "setup")]


setup(packages=qconvert_packages(os.path.dirname(os.path.abspath(__file__))), cmdclass={"build_py": BuildPy})
