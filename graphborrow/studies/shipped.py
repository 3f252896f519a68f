"""Where the shipped notebooks, the example sweep grid and the measured data live.

In the repository they are the top-level ``notebooks/`` and ``data/`` folders; installed
(wheel or editable) they are the subpackages ``graphborrow.notebooks`` and
``graphborrow.data`` (``setup.py`` maps one onto the other). Everything that needs them
asks here, through ``importlib.resources``, so ``python -m graphborrow suite`` works from
any directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["notebooks_dir", "data_dir", "example_grid", "example_sweep_results", "numbered_notebooks", "find_notebook"]

EXAMPLE_SWEEP = "capacity-example"  # the name in sweep_example.yaml: its folder under the sweep's --out


def _folder(package: str) -> Path:
    try:
        root = resources.files(package)
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            f"{package} is not installed with graphborrow; reinstall it (pip install graphborrow, "
            "or pip install -e . in a checkout)") from exc
    if not isinstance(root, Path):
        raise FileNotFoundError(
            f"{package} is installed inside an archive ({root}); papermill needs real files: "
            "install graphborrow unzipped (any pip install of the wheel does)")
    return root


def notebooks_dir() -> Path:
    """The folder holding the numbered notebooks and ``sweep_example.yaml``."""
    return _folder("graphborrow.notebooks")


def data_dir() -> Path:
    """The folder holding the measurements recorded on a GPU (``core_h200.json`` ...)."""
    return _folder("graphborrow.data")


def example_grid() -> Path:
    """The example sweep grid that ``python -m graphborrow run`` executes."""
    return notebooks_dir() / "sweep_example.yaml"


def example_sweep_results(search: tuple[str, ...] = ("output", "../output")) -> Path:
    """The example sweep's ``results.csv``: the one ``make run`` wrote (``output/capacity-example/``
    under the working directory or its parent, where a notebook in ``notebooks/`` runs), else the
    copy recorded under ``data/sweep_example/``.

    Args:
        search: folders, relative to the working directory, that may hold the sweep's output.
    """
    for folder in search:
        path = Path(folder) / EXAMPLE_SWEEP / "results.csv"
        if path.is_file():
            return path.resolve()
    return data_dir() / "sweep_example" / "results.csv"


def numbered_notebooks() -> list[Path]:
    """``00_overview.ipynb``, ``01_free_runs.ipynb`` ... in order."""
    return sorted(notebooks_dir().glob("[0-9][0-9]_*.ipynb"))


def find_notebook(name: str | Path) -> Path:
    """A notebook by path, or by name among the shipped ones.

    Args:
        name: an existing ``.ipynb`` path, or a shipped notebook's name with or without
            ``.ipynb`` (``06_capacity_sweep``) or its number prefix (``06``).

    Returns:
        The notebook's absolute path.
    """
    path = Path(name)
    if path.suffix == ".ipynb" and path.is_file():
        return path.resolve()
    if path.suffix == ".ipynb" and (len(path.parts) > 1 or path.is_absolute()):
        raise FileNotFoundError(f"notebook {path} does not exist")
    folder = notebooks_dir()
    stem = path.name.removesuffix(".ipynb")
    matches = (sorted(folder.glob(f"{stem}.ipynb")) or sorted(folder.glob(f"{stem}_*.ipynb"))
               or sorted(folder.glob(f"{stem}*.ipynb")))
    if len(matches) == 1:
        return matches[0]
    available = ", ".join(p.stem for p in numbered_notebooks())
    kind = "several shipped notebooks match" if matches else "no shipped notebook matches"
    raise FileNotFoundError(
        f"{kind} {str(name)!r}; give a path to an "
        f".ipynb file or one of: {available or 'none (the package data is missing)'}")
