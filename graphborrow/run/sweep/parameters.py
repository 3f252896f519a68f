"""Every notebook parameter a sweep may set, with its allowed values, stated once.

Sweeps, the suite and the command line check values here before anything runs, so a
typo costs a one-line error instead of a papermill run that fails a minute later.
Notebooks spell parameters in upper case (``BATCH_SIZE``); the command line accepts any
case (``-p batch_size 8``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from graphborrow.core.errors import ParameterError

__all__ = [
    "Range", "Choice", "IntList", "Text", "OptionalPath", "MODEL_NAMES", "PARAMETERS", "PATH_PARAMETERS", "canonical", "validate",
    "argument_type", "read_notebook", "declared_parameters",
]


@dataclass(frozen=True)
class Range:
    """Numbers in ``[lo, hi]``; ``integer`` rejects fractions; ``none_ok`` allows None."""

    lo: float
    hi: float
    integer: bool = True
    none_ok: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.none_ok:
            return
        kind = "an integer" if self.integer else "a number"
        ok_type = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type:
            raise ParameterError(f"{name}={value!r} must be {kind} in [{self.lo}, {self.hi}]")
        if not self.lo <= value <= self.hi:
            raise ParameterError(f"{name}={value!r} is out of range; allowed: {self.lo} to {self.hi}")

    def describe(self) -> str:
        return f"{self.lo}..{self.hi}" + (" or None" if self.none_ok else "")


@dataclass(frozen=True)
class Choice:
    """One of a fixed set of values; ``options`` may be a function giving them, called when they
    are first needed (so a set defined next to torch code is named here without importing torch)."""

    options: tuple | Callable[[], tuple]

    @property
    def values(self) -> tuple:
        return self.options() if callable(self.options) else self.options

    def check(self, name: str, value: Any) -> None:
        if not any(type(v) is type(value) and v == value for v in self.values):  # 1 is not True
            raise ParameterError(f"{name}={value!r} is not allowed; choose one of {list(self.values)}")

    def describe(self) -> str:
        return "|".join(map(str, self.values))


@dataclass(frozen=True)
class IntList:
    """A non-empty list of integers, each in ``[lo, hi]`` (e.g. a captured batch ladder)."""

    lo: int
    hi: int
    none_ok: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.none_ok:
            return
        if not isinstance(value, (list, tuple)) or not value:
            raise ParameterError(f"{name}={value!r} must be a non-empty list of integers in [{self.lo}, {self.hi}]")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
                raise ParameterError(
                    f"{name} entry {v!r} is out of range; allowed: integers {self.lo} to {self.hi}")

    def describe(self) -> str:
        return f"[{self.lo}..{self.hi}, ...]" + (" or None" if self.none_ok else "")


class Text:
    """A non-empty string (paths, names)."""

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise ParameterError(f"{name}={value!r} must be a non-empty string")

    def describe(self) -> str:
        return "text"


class OptionalPath(Text):
    """A path to an input file, or None for "build it here" (e.g. the reader's own snapshot)."""

    def check(self, name: str, value: Any) -> None:
        if value is not None:
            super().check(name, value)

    def describe(self) -> str:
        return "path or None"


# The workloads a notebook's MODEL builds: graphborrow.workloads.ladder.model_names(), spelled out here so
# that checking a parameter never imports torch (a test keeps the two equal).
MODEL_NAMES = ("synthetic", "llama-3-8b", "qwen2.5-7b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b")

def _verification_modes() -> tuple:
    from graphborrow.eagle.modes import (
        MODES,  # imports torch, so only when MODE is checked
    )

    return MODES


# Every notebook parameter a sweep may set, in one place (notebooks spell them in upper case).
# Ranges are what is physically meaningful for one GPU today, and every notebook must hold at
# every point of them (tests/run/test_notebook_points.py runs the corners and random points). The
# H200 shapes sit inside: hidden 4096, intermediate 14336, vocabulary 128256 (also 32000,
# 50257, 151936), prefill 8192 tokens, ladder 64...1, 8-16 draft tokens. Upper ends: the
# largest open models (hidden 16384 and intermediate 53248 in Llama-3.1-405B, 262144-token
# vocabularies in Gemma 3), SGLang's largest default captured batch (256) and EAGLE trees up
# to 64 draft tokens. LAYERS counts the synthetic model's MLP blocks inside each graph: the
# pool's idle runs come from one block's intermediates, which the next block reuses, so more
# blocks add weights, not runs; 4 keeps the largest corner inside one H200.
#
# PRESET picks the shapes (graphborrow/studies/presets.py): "teaching" computes on a CPU in
# seconds, "h200" is the Llama-3-8B shapes measured on the H200. A shape parameter left at None
# takes the preset's value; LAYOUT_ONLY None decides by the shapes' cost on a CPU.
PARAMETERS: dict[str, Any] = {
    "DEVICE": Choice(("auto", "cuda", "sim")),
    "PRESET": Choice(("teaching", "h200")),
    "OUTPUT_DIR": Text(),
    "SEED": Range(0, 2**31 - 1),
    "HIDDEN": Range(16, 16384, none_ok=True),
    "INTERMEDIATE": Range(16, 65536, none_ok=True),
    "LAYERS": Range(1, 4, none_ok=True),
    "VOCAB": Range(16, 262144, none_ok=True),
    "LADDER": IntList(1, 256, none_ok=True),
    "PREFILL_TOKENS": Range(1, 16384, none_ok=True),
    "BATCH_SIZE": Range(1, 256, none_ok=True),
    "BATCH_SIZES": IntList(1, 256),
    "DRAFT_TOKENS": Range(1, 64, none_ok=True),
    "DRAFT_TOKENS_LIST": IntList(1, 64),
    "BRANCHING": Range(1, 16),            # children per expanded draft-tree node (EAGLE's "topk")
    "DRAFT_NOISE": Range(0.0, 100.0, integer=False),  # 05: the draft model's distance from the target
    "MODEL": Choice(MODEL_NAMES),
    "SNAPSHOT": OptionalPath(),
    "FIT_POLICY": Choice(("best", "first")),
    "RUN_POLICY": Choice(("runs", "whole_segments")),
    "MODE": Choice(_verification_modes),
    "CHUNK_ROWS": Range(1, 1 << 24, none_ok=True),
    "TEMPERATURE": Range(1e-3, 100.0, integer=False),
    "TOP_K": Range(1, 262144, none_ok=True),
    "TOP_P": Range(1e-6, 1.0, integer=False, none_ok=True),
    "BUSY_MS": Range(1, 10_000),          # 03: how long the side stream works before it uses the borrowed tensor
    "SAMPLES": Range(1, 100_000),       # copies for 05's distribution checks: 12 categories need thousands
    "AGREEMENT": Range(0.0, 1.0, integer=False),  # 09: the draft's weights, a target + (1 - a) fresh
    "NEW_TOKENS": Range(1, 256),        # 09: new tokens per request of the decode loop
    "LAYOUT_ONLY": Choice((True, False, None)),
    "SWEEP_DIR": OptionalPath(),
    "DATA_DIR": Text(),
}

# Folders on the machine that runs the notebook: set by the runner, not part of what a
# point computes (its identity), and not columns of the results table.
PATH_PARAMETERS = ("OUTPUT_DIR",)


def canonical(name: str) -> str:
    """The notebook spelling of a parameter name (``batch_size`` -> ``BATCH_SIZE``).

    Args:
        name: a parameter name in any case.

    Returns:
        The name stripped and upper-cased (not checked against :data:`PARAMETERS`).

    Raises:
        ParameterError: ``name`` is not text.
    """
    if not isinstance(name, str):
        raise ParameterError(f"parameter names are text, got {name!r}; sweepable parameters: "
                             f"{', '.join(sorted(PARAMETERS))}")
    return name.strip().upper()


def validate(params: Mapping[str, Any], known: Iterable[str] | None = None) -> dict[str, Any]:
    """Check names and values against :data:`PARAMETERS` (and the notebook's own list).

    Args:
        params: parameter name (any case) -> value.
        known: the names the notebook's ``parameters`` cell declares; None skips that check.

    Returns:
        The same values under their canonical (upper-case) names.

    Raises:
        ParameterError: naming the parameter, the bad value and what is allowed (or that
            the runner sets it: :data:`PATH_PARAMETERS`).
    """
    known = set(known) if known is not None else None
    out: dict[str, Any] = {}
    for raw, value in params.items():
        name = canonical(raw)
        if name not in PARAMETERS:
            raise ParameterError(
                f"unknown parameter {raw!r}; sweepable parameters: {', '.join(sorted(PARAMETERS))}")
        if name in out:
            raise ParameterError(f"parameter {name} is given twice (as {raw!r} too); give it once")
        if name in PATH_PARAMETERS:
            raise ParameterError(
                f"{name} is set by the runner for each notebook (a sweep point's results/ folder, the suite's "
                f"--out/results), so a value given here would be ignored; choose where results go with --out")
        if known is not None and name not in known:
            raise ParameterError(
                f"parameter {name} is not declared in the notebook's parameters cell; "
                f"it declares {', '.join(sorted(known)) or 'nothing'}")
        PARAMETERS[name].check(name, value)
        out[name] = value
    return out


def argument_type(name: str, parse: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses a value and checks it against ``PARAMETERS[name]``.

    ``parser.add_argument("--batch", type=argument_type("BATCH_SIZE"))`` turns
    ``--batch -3`` into "argument --batch: BATCH_SIZE=-3 is out of range; allowed: 1 to 256".

    Args:
        name: the parameter whose rule applies (any case).
        parse: turns the command-line text into a value (``int``, ``float``, ...).

    Returns:
        The converter argparse calls; it raises ``argparse.ArgumentTypeError`` with the
        allowed range, which argparse reports as a usage error.
    """
    rule = PARAMETERS[canonical(name)]

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            kind = "a whole number" if parse is int else "a number" if parse is float else "valid"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}; allowed: {rule.describe()}") from None
        try:
            rule.check(canonical(name), value)
        except ParameterError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    convert.__name__ = canonical(name).lower()
    return convert


def read_notebook(notebook: str | Path):
    """The notebook as an ``nbformat`` node, with a clear error for anything else."""
    import nbformat

    path = Path(notebook)
    try:
        return nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise
    except Exception as exc:  # nbformat raises several types for a file that is not a notebook
        raise ParameterError(f"{path} is not a readable Jupyter notebook ({type(exc).__name__}: {exc})") from exc


def declared_parameters(notebook) -> set[str]:
    """Names assigned in the notebook's one cell tagged ``parameters``.

    Args:
        notebook: a path, or a notebook node from :func:`read_notebook`.

    Returns:
        The names, as spelled in the cell.

    Raises:
        ParameterError: the notebook has no or several cells tagged ``parameters``.
    """
    nb = read_notebook(notebook) if isinstance(notebook, (str, Path)) else notebook
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        where = notebook.name if isinstance(notebook, Path) else "the notebook"
        raise ParameterError(f"{where} must have exactly one cell tagged 'parameters', has {len(cells)}")
    return set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?::[^=]*)?=", cells[0].source, re.M))
