"""Recorded allocation sequences kept on disk, so that processes share what one recorded.

Recording a verification step's phases on the layout-only device (:mod:`.planner`) runs the
step's code operation by operation: a tenth of a second for a large tree, and a notebook
plans hundreds of steps. Every notebook, sweep point and test process used to record the
same shapes again. :func:`stored_sequences` records a phase once and keeps it in
``<cache>/sequences/<version>/`` (the cache of :func:`graphborrow.core.native.cache_dir`);
any process asking for the same phase later reads it back.

A stored sequence is exactly what recording it again gives: ``<version>`` is a hash of
graphborrow's own source files, the versions of torch and Python, torch's default dtype and
the allocator settings in the environment, so an edited source, an upgraded torch or other
settings record afresh. Read back, a sequence gets new allocation ids of this process
(:func:`graphborrow.planning.planner.renumbered`), so it composes with this process's own
recordings. A file that cannot be read, or names another key, is recorded again;
``GRAPHBORROW_SEQUENCE_CACHE=0`` turns the store off (every phase is recorded).

:class:`PhaseStore` keeps one kind of phases in memory too (the most recent ones), and can
record a phase it lacks while a replay listens (:meth:`PhaseStore.get`): a recording the
listener stopped is incomplete, and nothing of it is kept.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Hashable, Optional, Sequence

import torch

from graphborrow.allocator.compiled import PURE_ENV
from graphborrow.allocator.config import ENVIRONMENT as ALLOC_CONF
from graphborrow.core import variables
from graphborrow.core.native import cache_dir

from .planner import AllocationSequence, renumbered

__all__ = ["PhaseStore", "STORE_ENV", "store_enabled", "store_folder", "stored_sequences"]

STORE_ENV = "GRAPHBORROW_SEQUENCE_CACHE"
FORMAT = 1
KEEP_DAYS = 14  # versions of the sources not used for this long are removed
_VERSION: str | None = None
_VERSION_LOCK = threading.Lock()


def store_enabled() -> bool:
    """Whether recorded sequences are kept on disk (``GRAPHBORROW_SEQUENCE_CACHE``, default on)."""
    return variables.read(STORE_ENV, "1") != "0"


def _version() -> str:
    """The hash naming this process's sequences: sources, versions and settings they depend on."""
    global _VERSION
    with _VERSION_LOCK:
        if _VERSION is None:
            root = Path(__file__).resolve().parents[1]
            digest = hashlib.sha256()
            for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".pxd", ".pyx", ".c", ".h")):
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                digest.update(hashlib.sha256(path.read_bytes()).digest())
            for part in (torch.__version__, sys.version, str(torch.get_default_dtype()), str(FORMAT),
                         os.environ.get(ALLOC_CONF, ""), os.environ.get(PURE_ENV, "")):
                digest.update(part.encode() + b"\0")
            _VERSION = digest.hexdigest()[:20]
    return _VERSION


def store_folder() -> Path:
    """Where this process's version of the sources keeps its sequences."""
    return cache_dir() / "sequences" / _version()


def stored_sequences(kind: str, key: Sequence, record: Callable[[], Sequence[AllocationSequence]]
                     ) -> tuple[AllocationSequence, ...]:
    """The phases ``record()`` returns for ``(kind, key)``: read from the store, or recorded and stored.

    Args:
        kind: what is recorded (e.g. ``"verify-rows"``); with ``key`` it names the phases.
        key: everything the phases depend on besides the code, as JSON values (shapes, mode).
        record: records the phases (one recording's, sharing allocation ids).

    Returns:
        The phases, their allocation ids new in this process.
    """
    found = _stored(kind, key)
    if found is not None:
        return found
    phases = tuple(record())
    _keep(kind, key, phases)
    return phases


def _path(kind: str, key: Sequence) -> tuple[Path, str]:
    name = json.dumps([kind, list(key)], separators=(",", ":"))
    return store_folder() / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json", name


def _stored(kind: str, key: Sequence) -> Optional[tuple[AllocationSequence, ...]]:
    """The phases the store holds for ``(kind, key)`` with ids new to this process, or None."""
    if not store_enabled():
        return None
    path, name = _path(kind, key)
    found = _read(path, name)
    return None if found is None else renumbered(found)


def _keep(kind: str, key: Sequence, phases: tuple[AllocationSequence, ...]) -> None:
    if store_enabled():
        _write(*_path(kind, key), phases)


class PhaseStore:
    """One kind of recorded phases: the most recent ``size`` in memory, all of them on disk.

    Args:
        kind: what is recorded (names the files, with the key).
        record: ``record(*args, listener=None)`` records the phases for ``args``, handing the first
            phase's events to ``listener`` when given (see :meth:`graphborrow.planning.planner.Recording.phase`).
        key: the JSON values naming ``args`` on disk.
        size: how many keys are kept in memory.
    """

    def __init__(self, kind: str, record: Callable[..., Sequence[AllocationSequence]],
                 key: Callable[..., list], size: int = 1024) -> None:
        self.kind, self._record, self._key, self.size = kind, record, key, size
        self._memory: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, *args: Hashable) -> tuple[AllocationSequence, ...]:
        """The phases for ``args``: kept, stored, or recorded now."""
        return self.get(args)[0]

    def get(self, args: tuple, listener: Optional[Callable[[tuple], bool]] = None
            ) -> tuple[tuple[AllocationSequence, ...], bool]:
        """The phases for ``args``, and whether ``listener`` heard the first one.

        A kept or stored phase is returned unheard; one recorded now is recorded with
        ``listener`` listening to its first phase (heard: True).

        Raises:
            RecordingStopped: the listener stopped the recording; nothing is kept.
        """
        with self._lock:
            found = self._memory.get(args)
            if found is not None:
                self._memory.move_to_end(args)
                return found, False
        key = self._key(*args)
        found, heard = _stored(self.kind, key), False
        if found is None:
            found = tuple(self._record(*args, listener=listener))
            heard = listener is not None
            _keep(self.kind, key, found)
        with self._lock:
            self._memory[args] = found
            while len(self._memory) > self.size:
                self._memory.popitem(last=False)
        return found, heard

    def cache_clear(self) -> None:
        """Forget the phases kept in memory (the store on disk stays)."""
        with self._lock:
            self._memory.clear()


def _read(path: Path, name: str) -> tuple[AllocationSequence, ...] | None:
    try:
        data = json.loads(path.read_text())
        if data["name"] != name:
            return None
        return tuple(AllocationSequence(tuple((str(k), int(i), int(n), int(s)) for k, i, n, s in phase))
                     for phase in data["phases"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not there, damaged or another format: record it


def _write(path: Path, name: str, phases: tuple[AllocationSequence, ...]) -> None:
    """Store atomically (a temporary renamed into place); a store that cannot be written is skipped."""
    payload = json.dumps({"name": name, "phases": [[list(e) for e in p.events] for p in phases]},
                         separators=(",", ":"))
    try:
        fresh = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(payload)
        os.replace(tmp, path)
        if fresh:
            _remove_old_versions(path.parent)
    except OSError:
        pass


def _remove_old_versions(current: Path) -> None:
    """Remove the folders of source versions no process wrote to for :data:`KEEP_DAYS` days."""
    cutoff = time.time() - KEEP_DAYS * 86400
    for folder in current.parent.iterdir():
        try:
            if folder != current and folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass
