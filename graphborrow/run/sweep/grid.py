"""Sweep grids: fixed parameters plus axes, read from YAML or the command line.

A grid file is either the long form::

    name: capacity-example        # the sweep's folder name (optional)
    notebook: 06_capacity_sweep   # optional; the command line may name it instead
    plot_y: results.largest_saved_bytes
    parameters: {DEVICE: sim, LADDER: [16, 8, 4, 2, 1]}   # fixed
    grid: {VOCAB: [2048, 4096], MODE: [standard, lean]}   # axes

or a plain mapping where list values are axes and scalars are fixed. A flat list of
integers given to a list-valued parameter (``LADDER: [8, 4]``) is one value, not an axis;
an axis of ladders is a list of lists. Every malformed file gets an error naming the file
and the problem; nothing is run before the whole grid checks out.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from graphborrow.core.errors import ParameterError
from graphborrow.core.listsyntax import split_top_level

from .parameters import PARAMETERS, IntList, canonical, validate

__all__ = ["Grid", "parse_value", "parse_cli_values", "check_sweep_name"]

META_KEYS = ("name", "notebook", "plot_y")
LONG_FORM_KEYS = ("parameters", "grid")


def parse_value(text: str) -> Any:
    """One CLI value: YAML scalar or list (``8``, ``0.9``, ``best``, ``[64, 32]``, ``null``).

    Args:
        text: the value as typed.

    Returns:
        The parsed value (int, float, str, list or None); not yet checked against the rules.

    Raises:
        ParameterError: ``text`` is not valid YAML.
    """
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParameterError(f"cannot read value {text!r}: {exc}") from exc


def parse_cli_values(text: str) -> list:
    """``1,2,4`` -> [1, 2, 4]; a bracketed list stays one value: ``[64,32]`` -> [[64, 32]].

    Args:
        text: the comma list of a ``-p NAME VALUES`` option.

    Returns:
        The values, each parsed by :func:`parse_value`.

    Raises:
        ParameterError: a value is not valid YAML.
    """
    return [parse_value(part) for part in split_top_level(text)]


def check_sweep_name(name: Any, where: str = "sweep name") -> str:
    """A sweep name becomes one folder: plain text without path separators."""
    if not isinstance(name, str) or not name.strip():
        raise ParameterError(f"{where} must be non-empty text, got {name!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=+-]*", name):
        raise ParameterError(
            f"{where} {name!r} must be one folder name: letters, digits and . _ = + - "
            "(no spaces or slashes, not starting with a dot)")
    return name


def _scalars_as_written(text: str) -> dict[str, str]:
    """The top-level scalar values of a YAML mapping as typed (``0755``, not the 493 YAML reads)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: v.value for k, v in node.value
            if isinstance(k, yaml.ScalarNode) and isinstance(v, yaml.ScalarNode)}


def _is_axis(name: str, value: Any) -> bool:
    """A YAML list is an axis, except a flat list of ints for a list-valued parameter."""
    if not isinstance(value, list):
        return False
    list_valued = isinstance(PARAMETERS.get(name), IntList)
    return not (list_valued and value and all(isinstance(v, int) for v in value))


@dataclass
class Grid:
    """Fixed parameters plus axes; points are the cartesian product of the axes."""

    axes: dict[str, list] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    notebook: str | None = None
    plot_y: str | None = None  # the results column the summary plot shows

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Grid":
        """Read a grid file (see the module docstring for both forms).

        Args:
            path: the YAML file.

        Returns:
            The :class:`Grid`; its values are checked when the points are made.

        Raises:
            FileNotFoundError: the file does not exist.
            ParameterError: the file is not a YAML mapping of the expected form.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"grid file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ParameterError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
        except UnicodeDecodeError as exc:
            raise ParameterError(f"{path} is not a text file ({exc.reason})") from None
        if data is None:
            raise ParameterError(f"{path} is empty; a grid file maps parameters to values")
        written = _scalars_as_written(path.read_text())
        if not isinstance(data, dict):
            raise ParameterError(
                f"{path}: a grid file must be a mapping of parameter -> values, got a {type(data).__name__}")
        grid = cls()
        long_form = any(k in LONG_FORM_KEYS for k in data)
        for key in META_KEYS:
            if key in data:
                value = data.pop(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    raise ParameterError(f"{path}: '{key}' must be text, and YAML read {written.get(key, value)} "
                                         f"as the number {value!r}; quote it: {key}: \"{written.get(key, value)}\"")
                if not isinstance(value, str) or not value:
                    raise ParameterError(f"{path}: '{key}' must be non-empty text, got {value!r}")
                setattr(grid, key, value)
        if grid.name is not None:
            check_sweep_name(grid.name, f"{path}: name")
        if long_form:
            unknown = [k for k in data if k not in LONG_FORM_KEYS]
            if unknown:
                raise ParameterError(
                    f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; a grid file with 'grid:' "
                    f"may have only {', '.join(META_KEYS + LONG_FORM_KEYS)}")
            fixed, axes = data.get("parameters") or {}, data.get("grid") or {}
            for key, section in (("parameters", fixed), ("grid", axes)):
                if not isinstance(section, dict):
                    raise ParameterError(f"{path}: '{key}' must be a mapping of parameter -> value(s), "
                                         f"got {section!r}")
            grid._set_fixed(fixed, path)
            items = axes.items()
        else:
            items = data.items()
        for key, value in items:
            name = canonical(key)
            if _is_axis(name, value):
                grid._set_axis(key, value, path)
            else:
                grid._set_fixed({key: value}, path)
        return grid

    def _set_fixed(self, values: dict, where: Any) -> None:
        for key, value in values.items():
            name = canonical(key)
            if name in self.fixed or name in self.axes:
                raise ParameterError(f"{where}: parameter {name} is given twice; give it once")
            self._check_name(name, key, where)
            self.fixed[name] = value

    def _set_axis(self, raw: str, values: list, where: Any) -> None:
        name = canonical(raw)
        if name in self.fixed or name in self.axes:
            raise ParameterError(f"{where}: parameter {name} is given twice; give it once")
        self._check_name(name, raw, where)
        if not values:
            raise ParameterError(f"{where}: axis {name} has no values; give at least one value")
        self.axes[name] = list(values)

    @staticmethod
    def _check_name(name: str, raw: Any, where: Any) -> None:
        if name not in PARAMETERS:
            raise ParameterError(
                f"{where}: unknown parameter {raw!r}; sweepable parameters: {', '.join(sorted(PARAMETERS))}")

    def add_cli(self, pairs: Sequence[Sequence[str]]) -> None:
        """``-p NAME VALUES`` pairs: one value fixes the parameter, several make an axis.

        A command-line value replaces what the grid file says for the same parameter.

        Args:
            pairs: ``(name, values)`` pairs as argparse collects them; ``values`` is a comma list.

        Raises:
            ParameterError: an unknown parameter name, no values, or a parameter given twice.
        """
        given: dict[str, tuple[str, list]] = {}  # every pair checked before any is set
        for raw, text in pairs:
            name = canonical(raw)
            self._check_name(name, raw, "-p")
            if name in given:
                first = given[name][0]
                raise ParameterError(f"-p {raw} {text!r}: {name} is already given ({first!r}); give it once, "
                                     f"with every value in one comma list (-p {raw} {first},{text})")
            values = parse_cli_values(text)
            if not values:
                raise ParameterError(f"-p {raw} {text!r}: no values; give one value or a comma list")
            given[name] = (text, values)
        for name, (_, values) in given.items():
            self.fixed.pop(name, None)
            self.axes.pop(name, None)
            if len(values) == 1:
                self.fixed[name] = values[0]
            else:
                self.axes[name] = values

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the axes' values, each with the fixed parameters.

        Returns:
            One dict of parameters per point, the first axis varying slowest (unchecked).
        """
        names = list(self.axes)
        combos = itertools.product(*(self.axes[n] for n in names)) if names else [()]
        return [{**self.fixed, **dict(zip(names, combo))} for combo in combos]

    def validated_points(self, known: set[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`points`, each checked against the parameter rules; duplicates refused.

        Args:
            known: the names the notebook's ``parameters`` cell declares; None skips that check.

        Returns:
            The points, their values checked and names in the notebook's spelling.

        Raises:
            ParameterError: a name or value breaks a rule, or an axis lists a value twice.
        """
        points = [validate(p, known) for p in self.points()]
        for name, values in self.axes.items():
            seen = set()  # a set of canonical texts: an axis of thousands is checked in one pass
            for v in values:
                key = json.dumps(v, sort_keys=True, default=repr)  # True and 1 differ, as == would not say
                if key in seen:
                    raise ParameterError(f"axis {name} lists {v!r} twice; list each value once")
                seen.add(key)
        return points
