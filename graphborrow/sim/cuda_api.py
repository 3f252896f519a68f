"""``torch.cuda`` answered by a simulated device, so a program written for a GPU runs unmodified.

:func:`install` puts ``torch.cuda`` (and ``torch.cuda.memory`` / ``torch.cuda.graphs``) onto one
:class:`~graphborrow.sim.device.SimBackend` for the whole process: the device is active on the
calling thread and on every thread started from then on, as a GPU is visible to every thread.
:func:`simulated_cuda` is the same for the duration of a with block; installs nest, the
innermost answering. What is answered: availability and the device's properties (an H200),
streams, events, graphs and graph pool handles, ``MemPool`` / ``use_mem_pool`` and
``CUDAPluggableAllocator`` (calling the real C functions of a shared library), the memory
counters, ``memory_stats`` flat and nested, snapshots and memory history (with Python frames
when asked, as on a GPU), the RNG state (the CPU generator's, which the device's random
numbers come from) and ``is_current_stream_capturing``. What a simulated device cannot
answer (NVML queries, IPC, external streams, another allocator) is refused by name
(:data:`REFUSED`), and so is ``torch.compile`` (:meth:`SimCuda.compile`): never a crash
inside torch. Everything is put back by :func:`uninstall`.

Streams and events are thin wrappers (:class:`CudaStream`, :class:`CudaEvent`) over the
simulated ones, with the methods of ``torch.cuda.Stream`` / ``Event``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
import weakref
from typing import Iterator

import torch

from . import autocast, graphs, host, methods
from .mempool import MemPool as SimMemPool

__all__ = ["REFUSED", "CudaEvent", "CudaStream", "PluggableAllocator", "SimCuda", "gpu_available", "install",
           "installed", "simulated_cuda", "uninstall"]

_gpu_available = torch.cuda.is_available  # torch's own, whatever an install later puts in its place


def gpu_available() -> bool:
    """Whether torch sees a real GPU (``torch.cuda.is_available`` of torch, not of an install)."""
    return _gpu_available()


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

    def ipc_handle(self):
        raise _refusal("Event.ipc_handle", _NO_IPC)


def _sim_stream(stream):
    if isinstance(stream, CudaStream):
        return stream.sim_stream
    raise TypeError(f"expected a torch.cuda.Stream of the simulated device, got {type(stream).__name__}")


class _Properties(types.SimpleNamespace):
    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count})")


class PluggableAllocator:
    """``torch.cuda.memory.CUDAPluggableAllocator`` on the simulated device: the C functions
    ``void* alloc(ssize_t size, int device, cudaStream_t stream)`` and ``void free(void* ptr,
    ssize_t size, int device, cudaStream_t stream)`` of a shared library, called through ctypes
    for the segments of a ``MemPool`` built on it (the addresses they return are device
    addresses: a bump arena over simulated extents, as :class:`graphborrow.core.arena.BumpArena`)."""

    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        try:
            library = ctypes.CDLL(str(path_to_so_file))
        except OSError as exc:
            raise RuntimeError(f"CUDAPluggableAllocator: cannot load {path_to_so_file!r}: {exc}") from None
        try:
            self._alloc = getattr(library, alloc_fn_name)
            self._free = getattr(library, free_fn_name)
        except AttributeError as exc:
            raise RuntimeError(f"CUDAPluggableAllocator: {path_to_so_file!r} has no function {exc.args[0]}") from None
        self._alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self._alloc.restype = ctypes.c_void_p
        self._free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self._free.restype = None
        self.path = str(path_to_so_file)

    def allocator(self) -> "PluggableAllocator":
        """What ``torch.cuda.MemPool(...)`` takes (torch's ``_cuda_CUDAAllocator``): this object."""
        return self

    def raw_alloc(self, nbytes: int, stream: int = 0) -> int:
        return self._alloc(nbytes, 0, stream or None) or 0

    def raw_delete(self, address: int, nbytes: int, stream: int = 0) -> None:
        self._free(address, nbytes, 0, stream or None)

    def __repr__(self) -> str:
        return f"CUDAPluggableAllocator({self.path!r}, simulated)"


_NO_NVML = "the simulated device has no driver to query (NVML); it reports memory through mem_get_info and memory_stats"
_NO_IPC = "the simulated device lives in this process only; share tensors within it, or .cpu() them"
_NO_ALLOCATOR = ("the simulated device's allocator is torch's caching allocator; set PYTORCH_CUDA_ALLOC_CONF before "
                 "the first CUDA call, or use torch.cuda.MemPool(CUDAPluggableAllocator(...).allocator())")
# torch.cuda functions and classes a simulated device cannot answer -> what works instead
REFUSED = {
    "ExternalStream": "streams of another library do not exist here; use torch.cuda.Stream()",
    "get_stream_from_external": "streams of another library do not exist here; use torch.cuda.Stream()",
    "GreenContext": "the simulated device has no SM partitions; use torch.cuda.Stream()",
    "change_current_allocator": _NO_ALLOCATOR,
    "memory._set_allocator_settings": _NO_ALLOCATOR,
    "memory._get_current_allocator": _NO_ALLOCATOR,
    "cudart": "there is no CUDA runtime behind the simulated device; use the torch.cuda functions",
    "check_error": "there is no CUDA runtime behind the simulated device; use the torch.cuda functions",
    "caching_allocator_enable": "the simulated allocator always caches, as torch's does unless disabled; call "
                                "torch.cuda.empty_cache() to return cached blocks",
    "caching_allocator_disabled": "the simulated allocator always caches, as torch's does unless disabled; call "
                                  "torch.cuda.empty_cache() to return cached blocks",
    "current_blas_handle": "there is no cuBLAS behind the simulated device (its workspaces are modelled)",
    "current_solver_handle": "there is no cuSOLVER behind the simulated device",
    "ipc_collect": _NO_IPC,
    "list_gpu_processes": _NO_NVML,
    "device_memory_used": _NO_NVML,
    "memory_usage": _NO_NVML,
    "utilization": _NO_NVML,
    "temperature": _NO_NVML,
    "power_draw": _NO_NVML,
    "clock_rate": _NO_NVML,
    "host_memory_stats": "pinned host memory is not modelled; memory_stats covers the device",
    "host_memory_stats_as_nested_dict": "pinned host memory is not modelled; memory_stats covers the device",
    "reset_peak_host_memory_stats": "pinned host memory is not modelled; memory_stats covers the device",
    "reset_accumulated_host_memory_stats": "pinned host memory is not modelled; memory_stats covers the device",
}


def _refusal(name: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"torch.cuda.{name} has no answer on the simulated device: {instead}")


def _refuse(name: str, instead: str):
    def refused(*args, **kwargs):
        raise _refusal(name, instead)

    refused.__name__ = name.rsplit(".", 1)[-1]
    return refused


class SimCuda:
    """The replacement functions, bound to one backend (see :func:`install`)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.streams: dict[int, CudaStream] = {}
        self.threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # started while installed
        self.Stream, self.Event, self.CUDAGraph, self.graph, self.MemPool = _classes(self)
        self.default = self.Stream(_existing=backend.clock.default_stream)
        self._raw: dict[int, object] = {}  # caching_allocator_alloc address -> its storage
        self._sync_debug_mode = 0

    # devices
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        self.backend.initialise()
        return 0

    def set_device(self, device) -> None:
        _check_device(device)

    def exchange_device(self, device: int) -> int:
        """``torch.cuda._exchange_device`` (what ``with torch.cuda.device(i)`` calls): the previous device."""
        if device < 0:
            return -1
        _check_device(device)
        return 0

    def get_device_name(self, device=None) -> str:
        return self.get_device_properties(device).name

    def get_device_capability(self, device=None) -> tuple[int, int]:
        properties = self.get_device_properties(device)
        return properties.major, properties.minor

    def get_device_properties(self, device=None) -> _Properties:
        _check_device(device)
        self.backend.initialise()
        return _Properties(**self.backend.properties())

    def get_arch_list(self) -> list[str]:
        major, minor = self.get_device_capability()
        return [f"sm_{major}{minor}"]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return self.get_device_capability()[0] >= 8

    def is_tf32_supported(self) -> bool:
        return self.get_device_capability()[0] >= 8

    def can_device_access_peer(self, device, peer_device) -> bool:
        _check_device(device)
        _check_device(peer_device)
        return False  # one device: no peer

    def init(self) -> None:
        self.backend.initialise()

    def is_initialized(self) -> bool:
        return self.backend.initialised

    def get_sync_debug_mode(self) -> int:
        return self._sync_debug_mode

    def set_sync_debug_mode(self, debug_mode) -> None:
        self._sync_debug_mode = {"default": 0, "warn": 1, "error": 2}.get(debug_mode, debug_mode)

    def get_allocator_backend(self) -> str:
        return "native"

    # random numbers: the simulated device's come from the CPU generator
    def manual_seed(self, seed) -> None:
        pass  # torch.manual_seed seeds the CPU generator, which the device's random numbers use

    def seed(self) -> None:
        pass

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng_state(self, new_state, device="cuda") -> None:
        torch.set_rng_state(new_state)

    def set_rng_state_all(self, new_states) -> None:
        torch.set_rng_state(list(new_states)[0])

    # streams and events
    def _wrap(self, sim_stream) -> CudaStream:
        wrapped = self.streams.get(sim_stream.id)
        return wrapped if wrapped is not None else self.Stream(_existing=sim_stream)

    def current_stream(self, device=None) -> CudaStream:
        self.backend.initialise()
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
        self.backend.initialise()
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

    def reset_accumulated_memory_stats(self, device=None) -> None:
        with self.backend.allocator_call():
            self.backend.allocator.reset_accumulated_memory_stats()

    def memory_stats(self, device=None) -> dict:
        return self.backend.memory_stats()

    def memory_stats_as_nested_dict(self, device=None) -> dict:
        """``memory_stats`` as torch's allocator gives it (``memory_stats`` is its flattening)."""
        nested: dict = {}
        for key, value in self.backend.memory_stats().items():
            *path, leaf = key.split(".")
            level = nested
            for part in path:
                level = level.setdefault(part, {})
            level[leaf] = value
        return nested

    def memory_snapshot(self, mempool_id=None, include_traces: bool = True) -> list:
        return self.backend.memory_snapshot(mempool_id)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.backend.initialise()
        return self.backend.mem_get_info()

    def empty_cache(self) -> None:
        self.backend.empty_cache()

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        self.backend.set_per_process_memory_fraction(fraction)

    def get_per_process_memory_fraction(self, device=None) -> float:
        return self.backend.get_per_process_memory_fraction()

    def caching_allocator_alloc(self, size: int, device=None, stream=None) -> int:
        """A block from the caching allocator on ``stream`` (the current one when None); its address."""
        _check_device(device)
        context = self.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            storage = self.backend.new_storage(int(size))
        address = storage.block.ptr
        self._raw[address] = storage
        return address

    def caching_allocator_delete(self, mem_ptr: int) -> None:
        storage = self._raw.pop(int(mem_ptr), None)
        if storage is None:
            raise RuntimeError(f"caching_allocator_delete: {int(mem_ptr):#x} was not allocated by caching_allocator_alloc")
        del storage

    def record_memory_history(self, enabled="all", context="all", stacks="all", max_entries: int = 1_000_000,
                              **kwargs) -> None:
        on = enabled not in (None, False, "None")
        self.backend.record_memory_history(on, min(int(max_entries), 2**31), stacks=on and stacks in ("python", "all"))

    def snapshot(self, device=None, **kwargs) -> dict:
        return self.backend.full_snapshot()

    def dump_snapshot(self, filename: str = "dump_snapshot.pickle", **kwargs) -> None:
        self.backend.dump_snapshot(filename)

    def compile(self, *args, **kwargs):
        """``torch.compile`` on the simulated device: refused here, at the call, by name.

        TorchDynamo asks the CUDA driver for the current device (``torch._C._cuda_getDevice``) and
        builds CUDA kernels, neither of which a CPU build has. This is the one place to replace
        when a backend (``backend="cudagraphs"``) learns to run on the simulated device.
        """
        raise NotImplementedError(
            "torch.compile has no answer on the simulated device (TorchDynamo needs the CUDA driver); run the "
            "function eagerly (drop torch.compile), or capture it with torch.cuda.graph / torch.cuda.CUDAGraph")


def _classes(sim: "SimCuda") -> tuple:
    """``torch.cuda``'s classes for one backend: subclasses, so annotations and isinstance still work."""
    backend = sim.backend

    class Stream(CudaStream):
        def __new__(cls, device=None, priority: int = 0, _existing=None, **kwargs):
            _check_device(device)
            if _existing is None:  # a new stream initialises CUDA; wrapping an existing one does not
                backend.initialise()
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

        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "global", **kwargs) -> None:
            super().__init__(cuda_graph, pool=pool, stream=None if stream is None else _sim_stream(stream),
                             capture_error_mode=capture_error_mode)

    class MemPool(SimMemPool):
        def __init__(self, allocator=None, use_on_oom: bool = False, no_split: bool = False, **kwargs) -> None:
            super().__init__(backend, allocator, use_on_oom, no_split)

    return Stream, Event, CUDAGraph, graph, MemPool


def _check_device(device) -> None:
    if device is None:
        return
    if isinstance(device, str) and device == "cuda":
        return
    index = device if isinstance(device, int) else getattr(device, "index", None)
    if index is None and not isinstance(device, int):
        index = torch.device(device).index
    if index not in (None, 0):
        raise RuntimeError(f"the simulated device is a single GPU (cuda:0); got {device}. Use device='cuda'.")


_CUDA_NAMES = (
    "is_available", "device_count", "current_device", "set_device", "get_device_name", "get_device_capability",
    "get_device_properties", "get_arch_list", "is_bf16_supported", "is_tf32_supported", "can_device_access_peer",
    "init", "is_initialized", "get_sync_debug_mode", "set_sync_debug_mode", "get_allocator_backend",
    "manual_seed", "seed", "initial_seed", "get_rng_state", "get_rng_state_all", "set_rng_state",
    "set_rng_state_all", "Stream", "Event", "current_stream", "default_stream", "stream", "set_stream",
    "synchronize", "CUDAGraph", "graph", "graph_pool_handle", "is_current_stream_capturing", "MemPool",
    "use_mem_pool", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "reset_accumulated_memory_stats", "memory_stats", "memory_stats_as_nested_dict",
    "memory_snapshot", "mem_get_info", "empty_cache", "set_per_process_memory_fraction",
    "get_per_process_memory_fraction", "caching_allocator_alloc", "caching_allocator_delete",
)
# torch's name -> the replacement's, where torch's is private or another's alias
_ALIASES = {"manual_seed_all": "manual_seed", "seed_all": "seed", "_sleep": "sleep", "_lazy_init": "init",
            "_exchange_device": "exchange_device", "_maybe_exchange_device": "exchange_device",
            "StreamContext": "stream"}
_MEMORY_NAMES = ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
                 "memory_stats", "memory_stats_as_nested_dict", "memory_snapshot", "mem_get_info", "empty_cache",
                 "reset_peak_memory_stats", "reset_accumulated_memory_stats", "set_per_process_memory_fraction",
                 "get_per_process_memory_fraction", "MemPool", "use_mem_pool", "caching_allocator_alloc",
                 "caching_allocator_delete", "is_initialized", "get_allocator_backend")
_MEMORY_ALIASES = {"_record_memory_history": "record_memory_history", "_snapshot": "snapshot",
                   "_dump_snapshot": "dump_snapshot", "_lazy_init": "init"}
_GRAPHS_NAMES = ("CUDAGraph", "graph", "graph_pool_handle", "is_current_stream_capturing")


def _targets(sim: SimCuda) -> list[tuple[object, str, object]]:
    """Every ``(module, name, replacement)`` an install sets."""
    memory, graph_module = torch.cuda.memory, torch.cuda.graphs
    targets = [(torch.cuda, name, getattr(sim, name)) for name in _CUDA_NAMES]
    targets += [(torch.cuda, alias, getattr(sim, name)) for alias, name in _ALIASES.items()]
    targets += [(memory, name, getattr(sim, name)) for name in _MEMORY_NAMES]
    targets += [(memory, alias, getattr(sim, name)) for alias, name in _MEMORY_ALIASES.items()]
    targets += [(graph_module, name, getattr(sim, name)) for name in _GRAPHS_NAMES]
    targets += [(torch.cuda, "CUDAPluggableAllocator", PluggableAllocator),
                (memory, "CUDAPluggableAllocator", PluggableAllocator)]
    for name, instead in REFUSED.items():
        module, attribute = (memory, name.split(".", 1)[1]) if name.startswith("memory.") else (torch.cuda, name)
        targets.append((module, attribute, _refuse(name, instead)))
        if module is torch.cuda and attribute in vars(memory):
            targets.append((memory, attribute, _refuse(name, instead)))
    targets += [(torch, "compile", sim.compile), (torch, "clear_autocast_cache", autocast.clear_cache),
                (torch.utils.dlpack, "to_dlpack", methods.to_dlpack), (torch, "to_dlpack", methods.to_dlpack)]
    targets.append((threading.Thread, "start", _thread_start))
    return targets


class _Install:
    """One install: the SimCuda answering, what it replaced, the activation it made on its thread."""

    def __init__(self, sim: SimCuda) -> None:
        self.sim = sim
        targets = _targets(sim)
        self.saved = [(module, name, vars(module).get(name, _MISSING)) for module, name, _ in targets]
        for module, name, value in targets:
            setattr(module, name, value)
        self.activation = sim.backend.activated()
        self.activation.__enter__()

    def undo(self) -> None:
        try:
            self.activation.__exit__(None, None, None)
        finally:
            for module, name, value in reversed(self.saved):
                if value is _MISSING:
                    delattr(module, name)
                else:
                    setattr(module, name, value)


_MISSING = object()
_installs: list[_Install] = []  # innermost last
_install_lock = threading.Lock()
_original_thread_start = threading.Thread.start


def install(backend) -> SimCuda:
    """Make ``torch.cuda`` answer from ``backend`` for the whole process, until :func:`uninstall`.

    The backend is activated on this thread (``device="cuda"`` means it) and on every thread
    started from now on; threads already running are left as they are. Installing the device
    that answers already changes nothing (a re-run notebook cell); installing another one
    nests it inside.

    Args:
        backend: the :class:`~graphborrow.sim.device.SimBackend` that answers.

    Returns:
        The :class:`SimCuda` namespace of replacement functions (``.threads``: the threads started
        under it).
    """
    with _install_lock:
        if _installs and _installs[-1].sim.backend is backend:
            return _installs[-1].sim
        entry = _Install(SimCuda(backend))
        _installs.append(entry)
        torch.cuda._graphborrow_simulated = entry.sim
        return entry.sim


def uninstall(sim: SimCuda | None = None) -> None:
    """Undo the innermost :func:`install` (``sim``, when given, must be it): ``torch.cuda`` answers
    as before it, and the backend is no longer active on the thread that installed it.

    Raises:
        RuntimeError: ``sim`` is installed, but not innermost (uninstall the inner one first).
    """
    with _install_lock:
        if not _installs:
            return
        if sim is not None and _installs[-1].sim is not sim:
            if any(entry.sim is sim for entry in _installs):
                raise RuntimeError("another simulated device was installed inside this one; uninstall it first")
            return
        entry = _installs.pop()
        try:
            entry.undo()
        finally:
            torch.cuda._graphborrow_simulated = _installs[-1].sim if _installs else None


def installed() -> SimCuda | None:
    """The :class:`SimCuda` answering for ``torch.cuda`` now (the innermost install), or None."""
    return _installs[-1].sim if _installs else None


def _thread_start(thread: threading.Thread) -> None:
    """``Thread.start`` while a device is installed: the thread runs with it active, as every thread
    of a process sees its GPU."""
    sim = installed()
    if sim is not None and not getattr(thread, "_graphborrow_device", None):
        backend, run = sim.backend, thread.run

        def run_on_device():
            with backend.activated():
                run()

        thread.run = run_on_device
        thread._graphborrow_device = backend
        sim.threads.add(thread)
    return _original_thread_start(thread)


@contextlib.contextmanager
def simulated_cuda(backend) -> Iterator[SimCuda]:
    """Within the block, ``torch.cuda`` is ``backend`` (:func:`install`, then :func:`uninstall`).

    Args:
        backend: the :class:`~graphborrow.sim.device.SimBackend` that answers.

    Yields:
        The :class:`SimCuda` namespace of replacement functions.

    Raises:
        RuntimeError: ``backend`` already answers for ``torch.cuda`` (an install outside the block
            would end with it).
    """
    current = installed()
    if current is not None and current.backend is backend:
        raise RuntimeError("this simulated device already answers for torch.cuda; run without simulated_cuda")
    sim = install(backend)
    try:
        yield sim
    finally:
        uninstall(sim)
