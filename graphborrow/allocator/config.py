"""The allocator settings the simulated allocator models (``PYTORCH_CUDA_ALLOC_CONF``).

Parsing follows torch's own parser for the version being modelled: torch 2.9 moved the
generic options into ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig``),
which changed two details that this module keeps apart:

- ``max_split_size_mb`` and ``max_non_split_rounding_mb`` must be *more than* 20 before
  2.9 and *at least* 20 from 2.9 on;
- in a per-interval ``roundup_power2_divisions:[64:8,256:4,>:1]`` the ``>`` entry fills the
  intervals from the last named one *inclusive* before 2.9 (overwriting it) and from the
  one after it from 2.9 on.

A snapshot records the values that were in force (``allocator_settings``), and those
decide over the string: :meth:`AllocatorConfig.from_settings`.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from graphborrow.core.listsyntax import split_top_level
from graphborrow.core.sizes import LARGE_BUFFER, MB, ROUNDUP_INTERVALS

__all__ = ["AllocatorConfig", "ENVIRONMENT", "SIZE_MAX", "torch_version_tuple"]

ENVIRONMENT = "PYTORCH_CUDA_ALLOC_CONF"  # where torch's allocator reads its settings from
SIZE_MAX = 2**64 - 1
_ACCELERATOR_CONFIG = (2, 9)  # first torch with c10/core/AllocatorConfig.cpp
_IGNORED = (  # accepted and recorded, without effect on the device allocator's decisions
    "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
    "pinned_use_background_threads", "pinned_reserve_segment_size_mb", "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)


def torch_version_tuple(version: str | None) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130``; the installed torch's for None."""
    if version is None:
        import torch

        version = torch.__version__
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if not match:
        raise ValueError(f"cannot read a torch version from {version!r}; give it like '2.11.0'")
    return int(match.group(1)), int(match.group(2))


class AllocatorConfig:
    """The allocator options of one device, with torch's defaults.

    Args:
        config: ``PYTORCH_CUDA_ALLOC_CONF``-style string (``"max_split_size_mb:64,
            roundup_power2_divisions:[256:4,>:1]"``) or a dict of the same keys.
        torch_version: the torch whose parsing rules apply (default: the installed one).
    """

    KEYS = (
        "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
        "garbage_collection_threshold", "expandable_segments", "large_segment_size_mb",
        "per_process_memory_fraction", "graph_capture_record_stream_reuse", "backend", *_IGNORED,
    )

    def __init__(self, config: dict | str | None = None, torch_version: str | None = None) -> None:
        self.version = torch_version_tuple(torch_version)
        self.max_split_size = SIZE_MAX
        self.max_non_split_rounding_size = LARGE_BUFFER
        self.roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
        self.garbage_collection_threshold = 0.0
        self.expandable_segments = False
        self.large_segment_size = LARGE_BUFFER
        self.per_process_memory_fraction = 1.0
        self.graph_capture_record_stream_reuse = False
        self.source = config if isinstance(config, str) else ""
        self.ignored: dict[str, str] = {}
        if isinstance(config, str):
            config = _parse_string(config)
        elif config is not None and not isinstance(config, dict):
            raise TypeError(f"allocator config must be a string or a dict, got {type(config).__name__}")
        for key, value in (config or {}).items():
            self._set(str(key).strip(), value)

    @property
    def divisions(self) -> tuple[int, ...] | None:
        """The rounding table for :func:`graphborrow.core.sizes.round_size`, None when rounding is plain."""
        return self.roundup_power2_divisions if any(d > 1 for d in self.roundup_power2_divisions) else None

    @property
    def legacy(self) -> bool:
        return self.version < _ACCELERATOR_CONFIG

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None,
                         torch_version: str | None = None) -> "AllocatorConfig":
        """The settings ``PYTORCH_CUDA_ALLOC_CONF`` gives torch's allocator (torch's defaults when unset).

        Args:
            environ: where to read the variable (default ``os.environ``).
            torch_version: the torch whose parsing rules apply (default: the installed one).

        Returns:
            The :class:`AllocatorConfig`.

        Raises:
            ValueError, NotImplementedError: as the constructor, the message starting with
                the variable and its value.
        """
        text = (os.environ if environ is None else environ).get(ENVIRONMENT, "")
        try:
            return cls(text or None, torch_version)
        except (ValueError, NotImplementedError) as exc:
            raise type(exc)(f"{ENVIRONMENT}={text!r}: {exc}; fix it or unset it") from None

    @classmethod
    def from_settings(cls, settings: dict, torch_version: str | None = None) -> "AllocatorConfig":
        """The config a snapshot's ``allocator_settings`` describe (its recorded values decide over its string)."""
        if not isinstance(settings, dict):
            raise TypeError("allocator_settings must be the dict torch.cuda.memory._snapshot() records")
        config = cls(settings.get("PYTORCH_CUDA_ALLOC_CONF") or "", torch_version)
        if "max_split_size" in settings:
            recorded = int(settings["max_split_size"])
            config.max_split_size = SIZE_MAX if recorded < 0 else recorded
        if "garbage_collection_threshold" in settings:
            config.garbage_collection_threshold = float(settings["garbage_collection_threshold"])
        if "expandable_segments" in settings:
            config.expandable_segments = bool(settings["expandable_segments"])
        if settings.get("graph_capture_record_stream_reuse"):
            config._set("graph_capture_record_stream_reuse", True)
        table = settings.get("roundup_power2_divisions")
        if isinstance(table, dict) and table:
            ordered = [int(v) for _, v in sorted(table.items(), key=lambda kv: int(kv[0]))]
            if len(ordered) != ROUNDUP_INTERVALS:
                raise ValueError(f"roundup_power2_divisions has {len(ordered)} intervals, expected {ROUNDUP_INTERVALS}")
            config.roundup_power2_divisions = tuple(ordered)
        return config

    def settings(self) -> dict:
        """``allocator_settings`` as torch's ``_snapshot()`` reports them."""
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.source,
            "max_split_size": _as_int64(self.max_split_size),
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "pinned_num_register_threads": int(self.ignored.get("pinned_num_register_threads", 1)),
            "release_lock_on_cudamalloc": self.ignored.get("release_lock_on_cudamalloc") == "True",
            "pinned_use_cuda_host_register": self.ignored.get("pinned_use_cuda_host_register") == "True",
            "graph_capture_record_stream_reuse": self.graph_capture_record_stream_reuse,
            "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(self.roundup_power2_divisions)},
        }

    def __repr__(self) -> str:
        return f"AllocatorConfig({self.source or 'defaults'!r}, torch {self.version[0]}.{self.version[1]})"

    # ------------------------------------------------------------------ parsing

    def _set(self, key: str, value: Any) -> None:
        if key == "max_split_size_mb":
            self.max_split_size = self._split_limit_mb(key, value) * MB
        elif key == "max_non_split_rounding_mb":
            self.max_non_split_rounding_size = self._split_limit_mb(key, value) * MB
        elif key == "roundup_power2_divisions":
            self.roundup_power2_divisions = _parse_divisions(value, self.legacy)
        elif key == "garbage_collection_threshold":
            threshold = float(value)
            if not 0.0 < threshold < 1.0:
                raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0) as torch requires, got {threshold}")
            self.garbage_collection_threshold = threshold
        elif key == "expandable_segments":
            self.expandable_segments = _as_bool(key, value)
        elif key == "large_segment_size_mb":
            mb = _as_int(key, value)
            if mb * MB < 2 * MB or mb % 2:
                raise ValueError(f"large_segment_size_mb must be an even number of MB of at least 2, got {mb}")
            self.large_segment_size = mb * MB
        elif key == "per_process_memory_fraction":
            fraction = float(value)
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"per_process_memory_fraction must be within [0, 1], got {fraction}")
            self.per_process_memory_fraction = fraction
        elif key == "graph_capture_record_stream_reuse":
            self.graph_capture_record_stream_reuse = _as_bool(key, value)
        elif key == "backend":
            if str(value).strip() != "native":
                raise NotImplementedError(
                    f"backend:{value} is not modelled; the simulated allocator is torch's native caching allocator"
                )
        elif key in _IGNORED:
            self.ignored[key] = str(value).strip()
        else:
            raise ValueError(f"unknown allocator option {key!r}; known options: {', '.join(self.KEYS)}")

    def _split_limit_mb(self, key: str, value: Any) -> int:
        mb = _as_int(key, value)
        minimum = LARGE_BUFFER // MB
        if self.legacy and mb <= minimum:
            raise ValueError(f"{key}={mb} is too small: torch {self.version[0]}.{self.version[1]} requires more than {minimum}")
        if mb < minimum:
            raise ValueError(f"{key}={mb} is too small: it must be at least {minimum}")
        return min(mb, SIZE_MAX // MB)


def _parse_string(text: str) -> dict:
    options: dict[str, Any] = {}
    for item in split_top_level(text):
        key, sep, value = item.partition(":")
        if not sep or not value.strip():
            raise ValueError(f"allocator option {item!r} has no value; write it as key:value")
        options[key.strip()] = value.strip()
    return options


def _as_int(key: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer, got {value!r}") from None


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip()
    if text not in ("True", "False"):
        raise ValueError(f"{key} takes True or False (as torch spells them), got {value!r}")
    return text == "True"


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_divisions(value: Any, legacy: bool) -> tuple[int, ...]:
    """``N`` for every interval, or ``[64:8,256:4,>:1]`` / ``{64: 8, 256: 4, ">": 1}`` per MB interval."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            if not text.endswith("]"):
                raise ValueError(f"roundup_power2_divisions {text!r} opens '[' without closing it")
            pairs = []
            for item in text[1:-1].split(","):
                if item.strip():
                    key, sep, divisions = item.partition(":")
                    if not sep:
                        raise ValueError(f"roundup_power2_divisions entry {item!r} needs the form interval:divisions")
                    pairs.append((key.strip(), divisions.strip()))
            value = dict(pairs)
        else:
            value = _as_int("roundup_power2_divisions", text)
    if isinstance(value, int) and not isinstance(value, bool):
        if not _is_power_of_two(value):
            raise ValueError(f"roundup_power2_divisions must be a power of two, got {value}")
        return (value,) * ROUNDUP_INTERVALS
    if not isinstance(value, dict):
        raise ValueError(f"roundup_power2_divisions must be an int or a dict of MB -> divisions, got {value!r}")
    table = [0] * ROUNDUP_INTERVALS
    first, last_index = True, 0
    for key, divisions in value.items():
        divisions = _as_int("roundup_power2_divisions", divisions)
        if divisions != 0 and not _is_power_of_two(divisions):
            raise ValueError(f"roundup_power2_divisions values must be powers of two or 0, got {divisions}")
        if str(key).strip() == ">":
            start = last_index if legacy else last_index + 1
            for i in range(start, ROUNDUP_INTERVALS):
                table[i] = divisions
            continue
        mb = _as_int("roundup_power2_divisions interval", key)
        if not _is_power_of_two(mb):
            raise ValueError(f"roundup_power2_divisions intervals must be powers of two (MB), got {mb}")
        index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            for i in range(index):
                table[i] = divisions
            first = False
        table[index] = divisions
        last_index = index
    return tuple(table)


def _as_int64(n: int) -> int:
    return n - 2**64 if n >= 2**63 else n
