"""Points of a notebook's parameter space: its corners, the H200 shapes and random points.

A notebook must hold at every point of the ranges in :data:`~graphborrow.run.sweep.parameters.PARAMETERS`
for the parameters its ``parameters`` cell declares, not only at its defaults. This module
turns those ranges into concrete points to run: the low and the high corner (every declared
parameter at one end of its range), the H200 shapes, and a seeded random sample. Each point is
*derived* into a valid combination before it runs (a batch no larger than the largest captured
one, a branching factor the tree can hold, real bytes only where the CPU can hold them),
and the derived point is checked against the ranges again, so deriving never leaves them.

    points = notebook_points("notebooks/01_free_runs.ipynb", samples=2, seed=0)
    [(p.label, p.params) for p in points]
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from graphborrow.core.errors import ParameterError
from graphborrow.studies import presets

from .parameters import (
    PARAMETERS,
    Choice,
    IntList,
    Range,
    Text,
    declared_parameters,
    read_notebook,
    validate,
)

__all__ = ["Point", "H200", "REAL_VOCABS", "corner", "random_point", "derive", "footprint_bytes",
           "notebook_points", "BACKED_LIMIT_BYTES", "DEVICE_BYTES"]

# Not varied by the points: where the notebook runs and writes, which device it uses, and the
# preset (corners and random points set every shape themselves; the "h200" point is the preset).
FIXED = ("DEVICE", "OUTPUT_DIR", "SWEEP_DIR", "DATA_DIR", "PRESET")

# The shapes measured on the H200 (Llama-3-8B: DESIGN.md), as one point for a notebook without
# a PRESET parameter; a notebook with one gets PRESET="h200".
H200: dict[str, Any] = {
    **{k: v for k, v in presets.PRESETS["h200"].items() if k != "DTYPE"},
    "BATCH_SIZES": [64, 32, 16, 8, 4, 2, 1], "DRAFT_TOKENS_LIST": [8, 16], "LAYOUT_ONLY": True,
}

# Vocabularies of real models (Llama-2 / Mistral, GPT-2, Llama-3, Qwen2): random points use one
# of them half the time, so the sample always meets real shapes.
REAL_VOCABS = (32000, 50257, 128256, 151936)

# What one device holds: the simulated device's default capacity (80 GiB, an H100/A100-80GB;
# the H200 holds 141 GB). A point whose workload cannot fit it is derived to the largest that
# can, as a serving engine on one GPU would capture fewer or smaller graphs.
DEVICE_BYTES = 80 << 30

# Above this estimated footprint (or presets.BACKED_LIMIT_FLOPS of capture work) a point runs
# layout-only (when the notebook lets it): real bytes of that size on a 2-core CPU take minutes
# per notebook and prove nothing more.
BACKED_LIMIT_BYTES = presets.BACKED_LIMIT_BYTES


@dataclass(frozen=True)
class Point:
    """One point to run: a label ("defaults", "low", "high", "h200", "random-3") and parameters."""

    label: str
    params: dict

    def describe(self) -> str:
        return " ".join(f"{k}={v!r}" for k, v in sorted(self.params.items())) or "(defaults)"


def _ladder(top: int, lo: int) -> list[int]:
    """A serving ladder: ``top`` and its halvings down to ``lo`` (64, 32, ..., 1)."""
    out, bs = [], top
    while bs >= lo:
        out.append(bs)
        if bs == lo:
            break
        bs = max(lo, bs // 2)
    return out


def corner(names, which: str) -> dict[str, Any]:
    """Every declared parameter at the ``"low"`` or ``"high"`` end of its range.

    Args:
        names: the parameter names the notebook declares.
        which: "low" or "high".

    Returns:
        name -> value, before :func:`derive` (which makes the combination valid).
    """
    if which not in ("low", "high"):
        raise ValueError(f"which must be 'low' or 'high', got {which!r}")
    out: dict[str, Any] = {}
    for name in sorted(names):
        rule = PARAMETERS.get(name)
        if name in FIXED or rule is None or isinstance(rule, Text):
            continue
        if isinstance(rule, Range):
            value = rule.lo if which == "low" else rule.hi
            out[name] = int(value) if rule.integer else float(value)
        elif isinstance(rule, IntList):
            out[name] = [rule.lo] if which == "low" else _ladder(rule.hi, rule.lo)
        elif isinstance(rule, Choice):
            out[name] = rule.values[0] if which == "low" else rule.values[-1]
    return out


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    lo = max(lo, 1e-9)
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def random_point(names, rng: random.Random) -> dict[str, Any]:
    """A random point of the declared parameters (sizes log-uniform, so small and large both
    come up; vocabularies half the time a real model's).

    Args:
        names: the parameter names the notebook declares.
        rng: the random source (seed it: points must be reproducible).
    """
    out: dict[str, Any] = {}
    for name in sorted(names):
        rule = PARAMETERS.get(name)
        if name in FIXED or rule is None or isinstance(rule, Text):
            continue
        if name == "VOCAB" and rng.random() < 0.5:
            out[name] = rng.choice(REAL_VOCABS)
        elif isinstance(rule, Range):
            if rule.none_ok and rng.random() < 0.25:
                out[name] = None
            elif rule.integer:
                out[name] = min(int(rule.hi), max(int(rule.lo), round(_log_uniform(rng, rule.lo, rule.hi))))
            else:
                out[name] = min(rule.hi, max(rule.lo, round(_log_uniform(rng, rule.lo, rule.hi), 6)))
        elif isinstance(rule, IntList):
            top = 2 ** rng.randint(0, int(math.log2(rule.hi)))
            out[name] = _ladder(max(rule.lo, top), rule.lo)
        elif isinstance(rule, Choice):
            out[name] = rng.choice(rule.values)
    return out


def footprint_bytes(point: Mapping[str, Any], defaults: Mapping[str, Any]) -> int:
    """A rough upper estimate of the bytes a notebook at ``point`` holds on the device
    (:func:`graphborrow.studies.presets.footprint_bytes` of the point over the notebook's defaults)."""
    return presets.footprint_bytes({**defaults, **point})


def derive(point: Mapping[str, Any], declared, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Make ``point`` a valid combination for a notebook declaring ``declared``.

    - a batch is at most the largest captured decode batch (a serving engine pads up to a
      captured graph; it cannot run a larger one);
    - the tree's branching factor (BRANCHING) is at most its draft tokens less the root, TOP_K at most VOCAB;
    - a workload larger than one device (:data:`DEVICE_BYTES`) is shrunk, axis by axis, until it fits;
    - a point that asks for real bytes runs layout-only when they would cost a CPU more than
      seconds (:func:`graphborrow.studies.presets.too_large_for_cpu`) and the notebook declares
      LAYOUT_ONLY; a notebook at ``LAYOUT_ONLY=None`` decides by the same rule.

    Returns:
        The derived point, checked against the ranges.
    """
    defaults = dict(defaults or {})
    p = dict(point)
    value = lambda name: p.get(name, defaults.get(name))  # noqa: E731
    ladder = value("LADDER") or value("BATCH_SIZES")
    if ladder and "BATCH_SIZE" in declared and value("BATCH_SIZE") is not None:
        if value("BATCH_SIZE") > max(ladder):
            p["BATCH_SIZE"] = max(ladder)
    if "BRANCHING" in declared and value("DRAFT_TOKENS") is not None and value("BRANCHING") is not None:
        # a tree of D nodes (root included) has at most D - 1 children under one node
        if value("BRANCHING") > max(1, value("DRAFT_TOKENS") - 1):
            p["BRANCHING"] = max(1, value("DRAFT_TOKENS") - 1)
    if "TOP_K" in declared and value("TOP_K") is not None and value("VOCAB") is not None:
        if value("TOP_K") > value("VOCAB"):
            p["TOP_K"] = value("VOCAB")
    _fit_one_device(p, declared, defaults)
    if "LAYOUT_ONLY" in declared and value("LAYOUT_ONLY") is False and presets.too_large_for_cpu({**defaults, **p}):
        p["LAYOUT_ONLY"] = True
    validate(p, declared)
    return p


def _fit_one_device(p: dict, declared, defaults: Mapping[str, Any]) -> None:
    """Halve the batch axis, then the draft tokens, then the sequence and model widths, until the
    estimated footprint fits half of :data:`DEVICE_BYTES` (the estimate is rough: it leaves room
    for what it does not count). Every value stays inside its range."""
    value = lambda name: p.get(name, defaults.get(name))  # noqa: E731
    steps = [n for n in ("LADDER", "BATCH_SIZES", "BATCH_SIZE", "DRAFT_TOKENS", "DRAFT_TOKENS_LIST",
                         "PREFILL_TOKENS", "VOCAB", "INTERMEDIATE", "HIDDEN", "LAYERS") if n in declared]
    for _ in range(64):
        if footprint_bytes(p, defaults) <= DEVICE_BYTES // 2 or not steps:
            return
        name = steps[0]
        current, rule = value(name), PARAMETERS[name]
        if isinstance(rule, IntList):
            smaller = [v for v in current if v < max(current)] if len(current) > 1 else current
        else:
            smaller = max(int(rule.lo), int(current) // 2)
        if smaller == current:
            steps.pop(0)  # at its floor: shrink the next axis
            continue
        p[name] = smaller
        if name in ("LADDER", "BATCH_SIZES") and value("BATCH_SIZE") is not None and value("BATCH_SIZE") > max(smaller):
            p["BATCH_SIZE"] = max(smaller)
        steps.append(steps.pop(0))  # shrink the axes in turn


def _defaults(notebook) -> dict[str, Any]:
    """The values the parameters cell assigns (literals only; others are left out), shape
    parameters left at None replaced by the teaching preset's (what the notebook then runs)."""
    import ast

    nb = read_notebook(notebook) if isinstance(notebook, (str, Path)) else notebook
    cell = next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    out = {}
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    preset = presets.PRESETS["teaching"]
    return {**out, **{k: v for k, v in preset.items() if k in out and out[k] is None}}


def notebook_points(notebook, samples: int = 2, seed: int = 0, h200: bool = True) -> list[Point]:
    """The points a notebook must hold at: defaults, low and high corner, H200 shapes, randoms.

    Args:
        notebook: path of a numbered notebook (or its node).
        samples: how many random points.
        seed: the random points' seed (mixed with the notebook's name, so notebooks differ).
        h200: include the H200 shapes (when the notebook declares any of them).

    Returns:
        :class:`Point` s with derived, validated parameters (``DEVICE``/``OUTPUT_DIR`` not set).
    """
    nb = read_notebook(notebook) if isinstance(notebook, (str, Path)) else notebook
    declared = declared_parameters(nb)
    unknown = sorted(n for n in declared if n not in PARAMETERS)
    if unknown:
        raise ParameterError(f"the parameters cell declares {unknown}, which have no range in "
                             "graphborrow/run/sweep/parameters.py; add them there")
    defaults = _defaults(nb)
    points = [Point("defaults", {})]
    for which in ("low", "high"):
        points.append(Point(which, derive(corner(declared, which), declared, defaults)))
    if h200 and "PRESET" in declared:
        points.append(Point("h200", derive({"PRESET": "h200"}, declared, defaults)))
    elif h200 and declared & set(H200):
        shapes = {k: v for k, v in H200.items() if k in declared}
        points.append(Point("h200", derive(shapes, declared, defaults)))
    name = Path(getattr(notebook, "name", str(notebook))).stem if isinstance(notebook, (str, Path)) else "nb"
    rng = random.Random(f"{seed}:{name}")
    for k in range(samples):
        points.append(Point(f"random-{k}", derive(random_point(declared, rng), declared, defaults)))
    return points
