"""Packaging: the top-level notebooks/ and data/ folders ship inside the package.

They stay where a reader of the repository expects them, and are installed as the
subpackages ``graphborrow.notebooks`` and ``graphborrow.data`` (read with
``importlib.resources`` through :mod:`graphborrow.studies.shipped`). Everything else is
declared in pyproject.toml; this file only adds the mapping, which pyproject's
package discovery cannot express next to ``find``.
"""

from setuptools import find_namespace_packages, find_packages, setup

SHIPPED_FOLDERS = {"graphborrow.notebooks": "notebooks", "graphborrow.data": "data"}
# data/'s subfolders (traces/, notebooks_h200/ ...) hold files only; listing them keeps
# setuptools from warning that it found importable folders it was not told about.
DATA_SUBFOLDERS = [f"graphborrow.data.{name}"
                   for name in find_namespace_packages(where="data", exclude=["*__pycache__*"])]

setup(
    packages=find_packages(include=["graphborrow", "graphborrow.*"]) + list(SHIPPED_FOLDERS) + DATA_SUBFOLDERS,
    package_dir=SHIPPED_FOLDERS,
)
