"""``torch.cuda`` answered by a simulated device, so a script written for a GPU runs unmodified.

:func:`simulated_cuda` activates a :class:`~graphborrow.sim.device.SimBackend` and, for the
duration of a with block, replaces the functions and classes of ``torch.cuda`` (and of
``torch.cuda.memory``) that scripts and libraries call: availability and device queries
(an H200, compute capability 9.0), streams, events, graphs and graph pool handles,
``MemPool`` / ``use_mem_pool``, the memory counters, snapshots and memory history
(``_record_memory_history`` / ``_snapshot`` / ``_dump_snapshot``, with Python frames when
asked, as on a GPU), and ``is_current_stream_capturing``, which transformers asks before it
reads a tensor's values. Everything is put back on exit.

Streams and events are thin wrappers (:class:`CudaStream`, :class:`CudaEvent`) over the
simulated ones, with the methods of ``torch.cuda.Stream`` / ``Event`` (``wait_stream``,
``record_event``, use as a context manager, ...).
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
import types
from typing import Iterator

import torch

from . import graphs, host
from .cuda_ops import H200_CAPABILITY
from .pools import MemPool as SimMemPool

__all__ = ["CudaEvent", "CudaStream", "H200_NAME", "simulated_cuda"]

H200_NAME = "NVIDIA H200"
_MULTIPROCESSORS = 132
_FRAMES = 40  # innermost Python frames kept per allocation when history records stacks


class CudaStream(torch.Stream):
    """``torch.cuda.Stream`` on a simulated device (wraps its simulated stream).

    A ``torch.Stream`` (device ``cuda:0``, the simulated stream's id), so torch functions that
    take a stream (``Tensor.record_stream``) accept it.
    """

    def __new__(cls, backend, stream=None, priority: int = 0):
        sim_stream = stream if stream is not None else backend.Stream(priority=priority)
        self = super().__new__(cls, stream_id=sim_stream.id, device_index=0, device_type=1)
        self.sim_stream = sim_stream
        return self

    def __init__(self, backend, stream=None, priority: int = 0) -> None:
        self._backend, self._context = backend, None

    @property
    def cuda_stream(self) -> int:
        return self.sim_stream.id

    priority = property(lambda self: self.sim_stream.priority)

    def wait_stream(self, stream: "CudaStream") -> None:
        """Later work on this stream waits for the work queued on ``stream`` so far."""
        self.sim_stream.wait_stream(_sim_stream(stream))

    def wait_event(self, event: "CudaEvent") -> None:
        event.wait(self)

    def record_event(self, event: "CudaEvent | None" = None) -> "CudaEvent":
        """Record ``event`` (a new one when None) on this stream; returns it."""
        event = event if event is not None else CudaEvent(self._backend)
        event.record(self)
        return event

    def synchronize(self) -> None:
        if self._backend.capture_for_current_stream() is not None:
            raise host.not_permitted(self._backend)
        self.sim_stream.synchronize()

    def query(self) -> bool:
        return self.sim_stream.query()

    def __enter__(self) -> "CudaStream":
        self._context = self._backend.stream(self.sim_stream)
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(*exc)

    def __eq__(self, other) -> bool:
        return isinstance(other, CudaStream) and other.sim_stream is self.sim_stream

    def __hash__(self) -> int:
        return hash(("sim-stream", self.sim_stream.id))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:0 cuda_stream={self.sim_stream.id:#x} (simulated)>"


class CudaEvent:
    """``torch.cuda.Event`` on a simulated device."""

    def __init__(self, backend, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self._backend = backend
        self._event = backend.Event(enable_timing)
        self._stream = None

    def record(self, stream: "CudaStream | None" = None) -> None:
        self._stream = _sim_stream(stream) if stream is not None else self._backend.current_stream()
        self._event.record(self._stream)

    def wait(self, stream: "CudaStream | None" = None) -> None:
        self._event.wait(_sim_stream(stream) if stream is not None else None)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        graph = self._backend.captures.graph_on(self._stream.id) if self._stream is not None else None
        if graph is not None:  # the host cannot wait for work that is being captured, not run
            graph.invalidate()
            raise torch.AcceleratorError(host.EVENT_IN_CAPTURE)
        self._event.synchronize()

    def elapsed_time(self, end: "CudaEvent") -> float:
        """Milliseconds of simulated stream time between this event and ``end``."""
        start, stop = self._event._event.marker, end._event._event.marker
        if start is None or stop is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (stop - start) / 1000.0


def _sim_stream(stream):
    if isinstance(stream, CudaStream):
        return stream.sim_stream
    raise TypeError(f"expected a torch.cuda.Stream of the simulated device, got {type(stream).__name__}")


class _Properties(types.SimpleNamespace):
    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count})")


class _FrameRecorder:
    """Python frames of every allocation in order, as a GPU's ``stacks="python"`` history keeps them."""

    def __init__(self, backend) -> None:
        self.frames: list = []
        self._backend = backend
        self._new_storage = backend.new_storage

        def recorded(nbytes, _record=self.frames.append, _new=self._new_storage):
            stack = traceback.extract_stack(limit=_FRAMES)[:-1]
            _record([{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(stack)])
            return _new(nbytes)

        backend.new_storage = recorded

    def stop(self) -> None:
        self._backend.new_storage = self._new_storage

    def attach(self, snapshot: dict) -> dict:
        """Give each ``alloc`` trace entry its frames (one allocation per storage, in order)."""
        for trace in snapshot.get("device_traces", ()):
            allocs = [e for e in trace if e.get("action") == "alloc"]
            if len(allocs) == len(self.frames):
                for entry, frames in zip(allocs, self.frames):
                    entry["frames"] = frames
        return snapshot


class _SimCuda:
    """The replacement functions, bound to one backend (see :func:`simulated_cuda`)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.streams: dict[int, CudaStream] = {}
        self.recorder: _FrameRecorder | None = None
        self.Stream, self.Event, self.CUDAGraph, self.graph, self.MemPool = _classes(self)
        self.default = self.Stream(_existing=backend.clock.default_stream)

    # devices
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        _check_device(device)

    def get_device_name(self, device=None) -> str:
        return H200_NAME

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return H200_CAPABILITY

    def get_device_properties(self, device=None) -> _Properties:
        major, minor = H200_CAPABILITY
        return _Properties(name=H200_NAME, major=major, minor=minor, total_memory=self.backend.capacity,
                           multi_processor_count=_MULTIPROCESSORS, is_integrated=False)

    def init(self) -> None:
        pass

    def is_initialized(self) -> bool:
        return True

    def manual_seed(self, seed) -> None:
        pass

    # streams and events
    def _wrap(self, sim_stream) -> CudaStream:
        wrapped = self.streams.get(sim_stream.id)
        return wrapped if wrapped is not None else self.Stream(_existing=sim_stream)

    def current_stream(self, device=None) -> CudaStream:
        return self._wrap(self.backend.current_stream())

    def default_stream(self, device=None) -> CudaStream:
        return self.default

    def stream(self, stream):
        if stream is None:
            return contextlib.nullcontext()
        return self.backend.stream(_sim_stream(stream))

    def set_stream(self, stream) -> None:
        self.backend.set_current_stream(_sim_stream(stream))

    def synchronize(self, device=None) -> None:
        self.backend.synchronize()

    def sleep(self, cycles: int) -> None:
        self.backend.sleep(self.backend.current_stream(), cycles / 1500.0)  # ~1.5 GHz, as the GPU scripts assume

    # graphs
    def graph_pool_handle(self):
        return self.backend.graph_pool_handle()

    def is_current_stream_capturing(self) -> bool:
        return self.backend.capture_for_current_stream() is not None

    def use_mem_pool(self, pool, device=None):
        return self.backend.use_mem_pool(pool)

    # memory
    def _stat(self, key: str) -> int:
        return int(self.backend.memory_stats().get(key, 0))

    def memory_allocated(self, device=None) -> int:
        return self._stat("allocated_bytes.all.current")

    def max_memory_allocated(self, device=None) -> int:
        return self._stat("allocated_bytes.all.peak")

    def memory_reserved(self, device=None) -> int:
        return self._stat("reserved_bytes.all.current")

    def max_memory_reserved(self, device=None) -> int:
        return self._stat("reserved_bytes.all.peak")

    def reset_peak_memory_stats(self, device=None) -> None:
        with self.backend.allocator_call():
            self.backend.allocator.reset_peak_memory_stats()

    def memory_stats(self, device=None) -> dict:
        return self.backend.memory_stats()

    def memory_snapshot(self, mempool_id=None) -> list:
        return self.backend.memory_snapshot(mempool_id)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.backend.mem_get_info()

    def empty_cache(self) -> None:
        self.backend.empty_cache()

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        self.backend.set_per_process_memory_fraction(fraction)

    def get_per_process_memory_fraction(self, device=None) -> float:
        return self.backend.get_per_process_memory_fraction()

    def record_memory_history(self, enabled="all", context="all", stacks="all", max_entries: int = 1_000_000,
                               **kwargs) -> None:
        on = enabled not in (None, False, "None")
        self.backend.record_memory_history(on, max_entries)
        if self.recorder is not None:
            self.recorder.stop()
            self.recorder = None
        if on and stacks in ("python", "all"):
            self.recorder = _FrameRecorder(self.backend)

    def snapshot(self, device=None) -> dict:
        snapshot = self.backend.full_snapshot()
        return self.recorder.attach(snapshot) if self.recorder is not None else snapshot

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        with open(filename, "wb") as f:
            pickle.dump(self.snapshot(), f, protocol=4)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.stop()
            self.recorder = None


def _classes(sim: "_SimCuda") -> tuple:
    """``torch.cuda``'s classes for one backend: subclasses, so annotations and isinstance still work."""
    backend = sim.backend

    class Stream(CudaStream):
        def __new__(cls, device=None, priority: int = 0, _existing=None, **kwargs):
            _check_device(device)
            self = super().__new__(cls, backend, _existing, priority=priority)
            sim.streams[self.sim_stream.id] = self
            return self

        def __init__(self, device=None, priority: int = 0, _existing=None, **kwargs) -> None:
            super().__init__(backend)

    class Event(CudaEvent):
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
            super().__init__(backend, enable_timing, blocking, interprocess)

    class CUDAGraph(graphs.CUDAGraph):
        def __init__(self, keep_graph: bool = False) -> None:
            super().__init__(backend)

    class graph(graphs.graph):  # noqa: N801 (torch's name)
        default_capture_stream = None

        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "global") -> None:
            super().__init__(cuda_graph, pool=pool, stream=None if stream is None else _sim_stream(stream),
                             capture_error_mode=capture_error_mode)

    class MemPool(SimMemPool):
        def __init__(self, allocator=None, use_on_oom: bool = False, **kwargs) -> None:
            super().__init__(backend, allocator, use_on_oom)

    return Stream, Event, CUDAGraph, graph, MemPool


def _check_device(device) -> None:
    if device is None:
        return
    index = device if isinstance(device, int) else torch.device(device).index
    if index not in (None, 0):
        raise RuntimeError(f"the simulated device is a single GPU (cuda:0); got {device}. Use device='cuda'.")


_CUDA_NAMES = (
    "is_available", "device_count", "current_device", "set_device", "get_device_name", "get_device_capability",
    "get_device_properties", "init", "is_initialized", "manual_seed", "Stream", "Event", "current_stream",
    "default_stream", "stream", "set_stream", "synchronize", "CUDAGraph", "graph", "graph_pool_handle",
    "is_current_stream_capturing", "MemPool", "use_mem_pool", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "memory_stats", "memory_snapshot",
    "mem_get_info", "empty_cache", "set_per_process_memory_fraction", "get_per_process_memory_fraction",
)
# torch's name -> the replacement's, where torch's is private
_ALIASES = {"manual_seed_all": "manual_seed", "_sleep": "sleep"}
_MEMORY_ALIASES = {"_record_memory_history": "record_memory_history", "_snapshot": "snapshot",
                   "_dump_snapshot": "dump_snapshot"}
_MEMORY_NAMES = ("memory_allocated", "memory_reserved",
                 "max_memory_allocated", "max_memory_reserved", "memory_stats", "memory_snapshot", "mem_get_info",
                 "empty_cache", "reset_peak_memory_stats", "set_per_process_memory_fraction", "MemPool",
                 "use_mem_pool")


@contextlib.contextmanager
def simulated_cuda(backend) -> Iterator[object]:
    """Within the block, ``torch.cuda`` is ``backend`` (activated on this thread).

    Args:
        backend: the :class:`~graphborrow.sim.device.SimBackend` that answers.

    Yields:
        The namespace of replacement functions (``.streams``, ``.recorder`` for tests).

    Raises:
        RuntimeError: ``torch.cuda`` is already simulated by another block (nesting two
            devices would leave one of them answering for the other).
    """
    if getattr(torch.cuda, "_graphborrow_simulated", None) is not None:
        raise RuntimeError("torch.cuda is already answered by a simulated device; leave that block first")
    sim = _SimCuda(backend)
    targets = [(torch.cuda, name, getattr(sim, name)) for name in _CUDA_NAMES]
    targets += [(torch.cuda, alias, getattr(sim, name)) for alias, name in _ALIASES.items()]
    targets += [(torch.cuda.memory, name, getattr(sim, name)) for name in _MEMORY_NAMES]
    targets += [(torch.cuda.memory, alias, getattr(sim, name)) for alias, name in _MEMORY_ALIASES.items()]
    targets += [(torch.cuda.graphs, name, getattr(sim, name))
                for name in ("CUDAGraph", "graph", "graph_pool_handle", "is_current_stream_capturing")]
    saved = [(module, name, module.__dict__.get(name, _MISSING)) for module, name, _ in targets]
    with backend.activated():
        try:
            for module, name, value in targets:
                setattr(module, name, value)
            torch.cuda._graphborrow_simulated = sim
            yield sim
        finally:
            sim.close()
            for module, name, value in reversed(saved):
                if value is _MISSING:
                    delattr(module, name)
                else:
                    setattr(module, name, value)
            torch.cuda._graphborrow_simulated = None


_MISSING = object()
