"""The simulated CUDA device: ``SimBackend`` implements :class:`graphborrow.core.device_api.DeviceAPI`.

One SimBackend is one device: physical memory, streams with clocks, a caching
allocator that behaves like PyTorch's, tensors that are views of its bytes and CUDA
graphs that replay into the same addresses. Several may exist; each tensor remembers
its own. While a backend is *active* on a thread, ``device="cuda"`` in factory calls
means this device (a TorchFunctionMode is pushed; see :mod:`graphborrow.sim.function_mode`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import traceback
import weakref
from typing import Any, Iterator

import torch

from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.config import ENVIRONMENT, AllocatorConfig
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.streams import Clockwork, Stream
from graphborrow.core.device_api import DeviceAPI, ExternalBuffer
from graphborrow.core.interrupts import CRITICAL

from . import graphs, host
from .attention import AttentionModel
from .cuda_ops import H200_CAPABILITY, KernelModel
from .events import SimEvent, StreamContext
from .mempool import MemPool, SimPoolRouting
from .function_mode import SimFunctionMode
from .tensor import SimStorage, SimTensor, is_sim_tensor
from .torch_function import torch_functions_off
from .values import keeps_values

__all__ = ["GiB", "H200_MEMORY", "H200_NAME", "MAX_CAPACITY", "MemPool", "SimBackend", "SimEvent"]  # MemPool lives in .pools, SimEvent in .events

GiB = 2**30
# the GPU the simulated device is, as the H200 that recorded data/fuzz and data/models_h200 reports itself
H200_NAME = "NVIDIA H200"
H200_MEMORY = 150_109_880_320  # torch.cuda.mem_get_info()[1]
# device addresses start at 0x7F0000000000: with at most 2**63 bytes of memory (and as much again of virtual
# reservations) every address stays below 2**64, as a device pointer must
MAX_CAPACITY = 2**63
_FRAMES = 40  # innermost Python frames kept per allocation when history records stacks

_active = threading.local()  # .backend: the SimBackend active on this thread


class SimBackend(DeviceAPI):
    """A simulated CUDA device implementing :class:`~graphborrow.core.device_api.DeviceAPI`.

    ``capacity``: device memory in bytes (cudaMalloc past it raises torch's OOM); an H200's by
    default, the GPU the simulated device answers for (:meth:`properties`).
    ``backed``: real bytes behind every segment; ``False`` is layout-only (META tensors:
    exact shapes and allocator state, no arithmetic; for big sweeps).
    ``config``: allocator settings (e.g. ``{"roundup_power2_divisions": 4}``); None takes them
    from ``PYTORCH_CUDA_ALLOC_CONF`` as torch's allocator does: when it initialises, at the first
    CUDA use (:meth:`initialise`), so a program may set the variable before that (its defaults
    when unset).
    ``activate``: make ``device="cuda"`` mean this device on the calling thread.
    ``blas_workspace``: bytes of the cuBLAS workspace the first matmul on each stream
    allocates and keeps (32 MiB, as torch 2.11 on an H200); 0 leaves it out.
    ``blaslt_workspace``: bytes of the cuBLASLt workspace the first bias-fused ``addmm``
    (cuBLASLt) on each stream allocates after its output and keeps (1 MiB, as torch 2.11
    on an H200); 0 leaves it out.
    ``attention``: how ``scaled_dot_product_attention`` behaves as on CUDA (which backend,
    its outputs and temporaries): a :class:`graphborrow.sim.attention.AttentionModel`.
    ``kernels``: what other CUDA kernels allocate while they run (CUB scans, CUTLASS
    grouped GEMM): a :class:`graphborrow.sim.cuda_ops.KernelModel`.
    """

    name = "sim"
    device = "cuda"
    simulated = True
    OutOfMemoryError = torch.OutOfMemoryError

    def __init__(
        self,
        capacity: int = H200_MEMORY,
        backed: bool = True,
        config: dict | None = None,
        activate: bool = True,
        blas_workspace: int = 32 * 2**20,
        attention: AttentionModel | None = None,
        blaslt_workspace: int = 2**20,
        kernels: KernelModel | None = None,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 0 < capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be a whole number of bytes from 1 to 2**63 (so that device addresses stay "
                             f"below 2**64), got {capacity!r}")
        self.capacity = capacity
        self.backed = bool(backed)
        self.memory = PhysicalMemory(capacity=capacity, backed=self.backed)
        self.clock = Clockwork()
        # None: read PYTORCH_CUDA_ALLOC_CONF now (a bad value is refused before any work) and again at
        # initialisation, which is when torch's allocator reads it
        self._environment_config = os.environ.get(ENVIRONMENT, "") if config is None else None
        if config is None:
            config = AllocatorConfig.from_environment()
        self.allocator = CachingAllocator(self.memory, self.clock, config)
        self._initialised = False
        self._lock = threading.RLock()
        self._depth = 0  # > 0 while inside an allocator call (frees then wait in _pending)
        self._pending: list = []
        self._owners: dict = {}  # block -> _StorageOwner of the storage that frees it
        self._dead: list = []  # owners whose storage died (appended by the weakref machinery)
        self._tls = threading.local()
        self.captures = graphs.CaptureRegistry()  # capturing stream id -> graph (graphs.py owns it)
        self._capture_stream: Stream | None = None
        self._mode = SimFunctionMode(self)
        self._active_threads: set[int] = set()
        self.blas_workspace = int(blas_workspace)
        self.attention = attention if attention is not None else AttentionModel()
        self.blaslt_workspace = int(blaslt_workspace)
        self.kernels = kernels if kernels is not None else KernelModel()
        self._blas_workspaces: dict[int, SimStorage] = {}  # stream id -> workspace
        self.blas_handle = False  # whether a cuBLAS handle exists (the first matmul outside a capture makes it)
        self._blaslt_workspaces: dict[int, SimStorage] = {}  # stream id -> cuBLASLt workspace
        self._generator_state: list[SimStorage] | None = None
        self.cudnn_graphs: set = set()  # attention calls whose cuDNN graph is built (torch caches them)
        self._generator_users = 0  # graphs that registered the RNG state
        self._frames: list | None = None  # Python frames per allocation, with stacks history
        self._closed = False
        if activate:
            self.activate()

    # ------------------------------------------------------------------ activation
    def activate(self) -> "SimBackend":
        """Make ``device="cuda"`` mean this device on the calling thread (replacing another sim).

        Returns:
            This backend, so ``SimBackend(activate=False).activate()`` chains.

        Raises:
            RuntimeError: the backend was closed.
        """
        self._check_open()
        current = getattr(_active, "backend", None)
        if current is self:
            return self
        if current is not None:
            current.deactivate()
        self._mode.__enter__()
        _active.backend = self
        self._active_threads.add(threading.get_ident())
        return self

    def deactivate(self) -> None:
        """Stop mapping ``device="cuda"`` onto this device on the calling thread."""
        if getattr(_active, "backend", None) is not self:
            return
        top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
        if top is not self._mode:
            raise RuntimeError(
                "cannot deactivate the simulated device: another TorchFunctionMode was entered after "
                f"it and is still active ({type(top).__name__}); exit that mode first"
            )
        self._mode.__exit__(None, None, None)
        _active.backend = None
        self._active_threads.discard(threading.get_ident())

    @contextlib.contextmanager
    def activated(self) -> Iterator["SimBackend"]:
        """Active for the duration of the block (e.g. in a worker thread), then restored.

        Yields:
            This backend; on exit the simulated device active before, if any, is active again.
        """
        previous = getattr(_active, "backend", None)
        if previous is self:  # already active: leave it so
            yield self
            return
        self.activate()
        try:
            yield self
        finally:
            self.deactivate()
            if previous is not None and previous is not self and not previous._closed:
                previous.activate()

    @property
    def is_active(self) -> bool:
        return getattr(_active, "backend", None) is self

    def close(self) -> None:
        """Deactivate on this thread and stop serving frees; tensors still alive become inert."""
        if self._closed:
            return
        self.deactivate()
        self._closed = True

    def __enter__(self) -> "SimBackend":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this simulated device was closed; create a new SimBackend")

    def initialise(self) -> None:
        """What torch's lazy CUDA initialisation does for the allocator: read ``PYTORCH_CUDA_ALLOC_CONF``
        (when ``config`` was None). Runs at the first allocation, pool or query that initialises CUDA
        in torch; later changes to the variable have no effect, as in torch.

        Raises:
            ValueError, NotImplementedError: the variable, set since the device was made, is not
                a setting torch accepts (named, with its value).
        """
        if self._initialised:
            return
        self._initialised = True
        text = os.environ.get(ENVIRONMENT, "") if self._environment_config is not None else None
        if text is None or text == self._environment_config:
            return
        config = AllocatorConfig.from_environment()
        old = self.allocator
        fresh = CachingAllocator(self.memory, self.clock, config)
        if old.history is not None:  # history switched on before the first use goes on recording
            fresh.record_history(True, old.history.maxlen)
        self.allocator = fresh

    @property
    def initialised(self) -> bool:
        """Whether the device was initialised (``torch.cuda.is_initialized``)."""
        return self._initialised

    def properties(self) -> dict[str, Any]:
        """What ``torch.cuda.get_device_properties`` reports for the simulated GPU.

        Returns:
            ``name``, ``major``, ``minor``, ``total_memory`` (the capacity), ``multi_processor_count``
            (the kernel model's) and ``is_integrated``.
        """
        major, minor = H200_CAPABILITY
        return {"name": H200_NAME, "major": major, "minor": minor, "total_memory": self.capacity,
                "multi_processor_count": self.kernels.multiprocessors, "is_integrated": False}

    # ------------------------------------------------------------- streams and sync
    def current_stream(self) -> Stream:
        """The calling thread's current stream; a borrow pool is pinned to the one it was built on.

        Returns:
            A simulated :class:`~graphborrow.allocator.streams.Stream` (the default stream, id 0,
            unless a :meth:`stream` block chose another).
        """
        return getattr(self._tls, "stream", None) or self.clock.default_stream

    def current_stream_key(self) -> int:
        """A cheap identity of the current stream (its id).

        Returns:
            The stream's id; the borrow scope compares it on every entry.
        """
        return self.current_stream().id

    def set_current_stream(self, s: Stream) -> None:
        """Make ``s`` the calling thread's current stream until changed (``torch.cuda.set_stream``).

        Args:
            s: a stream from :meth:`Stream` (or the default stream).
        """
        self._tls.stream = s

    def Stream(self, priority: int = 0) -> Stream:
        """A new side stream with its own clock, as ``torch.cuda.Stream``.

        Args:
            priority: recorded for torch's signature; the simulated streams do not schedule by it.

        Returns:
            A simulated :class:`~graphborrow.allocator.streams.Stream` with the next free id.
        """
        return self.clock.new_stream(priority=priority)

    def stream(self, s: Stream | None) -> StreamContext:
        """Make ``s`` the calling thread's current stream for a with block, as ``torch.cuda.stream``.

        Args:
            s: a stream from :meth:`Stream`; None leaves the current stream as it is.

        Returns:
            The context manager (it gives ``s`` to ``as``).

        Raises:
            TypeError: ``s`` is not a simulated stream.
        """
        if s is not None and not isinstance(s, Stream):
            raise TypeError(f"expected a simulated Stream from backend.Stream(), got {type(s).__name__}")
        return StreamContext(self, s)

    def Event(self, enable_timing: bool = False) -> SimEvent:
        """A new event, as ``torch.cuda.Event``.

        Args:
            enable_timing: accepted for torch's signature; simulated events carry no timing.

        Returns:
            A :class:`SimEvent`.
        """
        return SimEvent(self)

    def synchronize(self) -> None:
        """Wait for every stream, as ``torch.cuda.synchronize``.

        Raises:
            torch.AcceleratorError: the current stream is capturing a graph (which this invalidates).
        """
        if self.capture_for_current_stream() is not None:
            raise host.not_permitted(self)
        self.clock.synchronize()

    def sleep(self, stream: Stream, microseconds: float) -> None:
        """Keep ``stream`` busy for ``microseconds`` (like ``torch.cuda._sleep``).

        Events recorded on ``stream`` after this complete only once its clock has run that long,
        which is what keeps a ``record_stream`` free pending.

        Args:
            stream: the stream that is busy.
            microseconds: how long, in simulated microseconds.
        """
        stream.enqueue(microseconds)

    def touch(self) -> None:
        """One small allocation: lets the allocator process completed events."""
        storage = self.new_storage(4)
        del storage

    # ------------------------------------------------------------------- pools, graphs
    def graph_pool_handle(self) -> tuple[int, int]:
        return self.new_pool_id(graph=False)

    def CUDAGraph(self) -> graphs.CUDAGraph:
        """An empty graph to capture into; its replay re-runs the kernels into the same addresses.

        Returns:
            A simulated ``CUDAGraph``.
        """
        return graphs.CUDAGraph(self)

    def graph(self, g, pool=None, stream=None) -> graphs.graph:
        """Capture the with block's work into ``g``, as ``torch.cuda.graph``.

        Args:
            g: a graph from :meth:`CUDAGraph`.
            pool: the pool handle to capture into (None: a private pool of its own).
            stream: the stream to capture on (None: :meth:`default_capture_stream`).

        Returns:
            The capture's context manager.
        """
        return graphs.graph(g, pool=pool, stream=stream)

    def MemPool(self, allocator=None, use_on_oom: bool = False, no_split: bool = False) -> MemPool:
        """A private pool, as ``torch.cuda.MemPool``.

        Args:
            allocator: an object with ``raw_alloc`` / ``raw_delete`` whose memory the pool's
                segments use (a :class:`~graphborrow.core.arena.BumpArena`); None for device memory.
            use_on_oom: let other allocations use this pool's cached memory when the device
                is out of memory.
            no_split: never split the pool's blocks.

        Returns:
            A :class:`MemPool`.
        """
        return MemPool(self, allocator, use_on_oom, no_split)

    def arena_pool(self, arena) -> MemPool:
        """A MemPool whose segments come from ``arena`` (host calls into the C bump arena).

        Args:
            arena: the :class:`~graphborrow.core.arena.BumpArena` whose extents the pool's
                segments are carved from.

        Returns:
            A :class:`MemPool`; the caching allocator still splits its segments into blocks.
        """
        return MemPool(self, arena)

    def route_to_pool(self, pool):
        """The borrow scope's per-step routing; on the simulator simply ``use_mem_pool``.

        Args:
            pool: the borrow pool (a :class:`MemPool`).

        Returns:
            The context manager of :meth:`use_mem_pool`.
        """
        return self.use_mem_pool(pool)

    def use_mem_pool(self, pool) -> "SimPoolRouting":
        """Route this thread's allocations to ``pool`` (no stream filter, as in torch 2.8+).

        Args:
            pool: a :class:`MemPool`, or a pool id.

        Returns:
            The context manager.
        """
        return SimPoolRouting(self, self.pool_id(pool))

    def pool_id(self, pool) -> tuple[int, int]:
        """The id snapshots use for ``pool`` (``segment_pool_id``).

        Args:
            pool: a :class:`MemPool`, or a pool id (given back as a tuple).

        Returns:
            The pool's id as a tuple of two ints.
        """
        return tuple(pool.id) if hasattr(pool, "id") else tuple(pool)

    def new_pool_id(self, graph: bool) -> tuple[int, int]:
        """``(uid, 0)`` for a capture without a pool, ``(0, uuid)`` for handles and MemPools.

        Args:
            graph: True for a capture that was given no pool, False for a handle or MemPool.

        Returns:
            A fresh pool id, numbered as torch numbers them.
        """
        self.initialise()
        with self._lock:
            return self.allocator.new_pool_id("graph" if graph else "handle")

    def default_capture_stream(self) -> Stream:
        """The side stream ``graph(...)`` captures on when given none (one per device, like torch's).

        Returns:
            That stream, made on first use.
        """
        if self._capture_stream is None:
            self._capture_stream = self.Stream()
        return self._capture_stream

    def capture_for_current_stream(self):
        """The graph the current stream is capturing into, or None.

        Returns:
            The capturing graph, or None outside a capture (operations that would break a
            capture, like synchronising, check this).
        """
        if not self.captures:
            return None
        return self.captures.graph_on(self.current_stream().id)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: tensors still alive are inert."""
        return self._closed

    # ----------------------------------------------------------------- introspection
    def memory_snapshot(self, pool_id=None) -> list[dict]:
        with self.allocator_call():
            return self.allocator.snapshot(None if pool_id is None else tuple(pool_id))

    def memory_stats(self) -> dict[str, Any]:
        return self.allocator.memory_stats()

    def memory_reserved(self) -> int:
        return self.allocator.memory_reserved()

    def memory_allocated(self) -> int:
        return self.allocator.memory_allocated()

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: new segments may take at most this share of
        the device; with ``garbage_collection_threshold`` set, old cached segments are collected above it.

        Args:
            fraction: the share of ``capacity``, between 0 and 1.
            device: accepted for torch's signature (there is one simulated device).
        """
        with self.allocator_call():
            self.allocator.set_memory_fraction(float(fraction))

    def get_per_process_memory_fraction(self, device=None) -> float:
        """The share set by :meth:`set_per_process_memory_fraction`.

        Args:
            device: accepted for torch's signature (there is one simulated device).

        Returns:
            The fraction (1.0 when never set).
        """
        return self.allocator.get_memory_fraction()

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total device memory as the driver sees it: the physical measure.

        Returns:
            ``(free, total)`` in bytes; ``total`` is ``capacity``.
        """
        return self.memory.mem_get_info()

    def empty_cache(self) -> None:
        with self.allocator_call():
            self.allocator.empty_cache()

    def record_memory_history(self, enabled: bool = True, max_entries: int = 1_000_000, stacks: bool = False) -> None:
        """Like ``torch.cuda.memory._record_memory_history``.

        Args:
            enabled: record allocator events as trace entries; False stops recording.
            max_entries: how many entries the ring buffer keeps.
            stacks: keep the Python frames of every allocation (``stacks="python"`` on a GPU).
        """
        self.allocator.record_history(enabled, max_entries)
        self._frames = [] if enabled and stacks else None

    def full_snapshot(self) -> dict:
        """Like ``torch.cuda.memory._snapshot()``: segments, device traces, settings.

        Returns:
            A dict with ``"segments"``, ``"device_traces"`` and ``"allocator_settings"``,
            readable by PyTorch's memory_viz; with ``stacks`` history, each ``alloc`` entry has
            its ``frames``.
        """
        with self.allocator_call():
            snapshot = self.allocator.full_snapshot()
        if self._frames is not None:
            for trace in snapshot.get("device_traces", ()):
                allocs = [e for e in trace if e.get("action") == "alloc"]
                if len(allocs) == len(self._frames):  # one allocation per storage, in order (none lost)
                    for entry, frames in zip(allocs, self._frames):
                        entry["frames"] = frames
        return snapshot

    def dump_snapshot(self, path: str | os.PathLike) -> dict:
        """Pickle :meth:`full_snapshot` like ``torch.cuda.memory._dump_snapshot``.

        Open the file at https://pytorch.org/memory_viz (or with torch's ``_memory_viz``); call
        :meth:`record_memory_history` first to get a trace, not only segments.

        Args:
            path: the file to write.

        Returns:
            The snapshot written.

        Raises:
            FileNotFoundError: the folder of ``path`` does not exist.
        """
        path = os.fspath(path)
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"cannot write {path!r}: folder {folder!r} does not exist; create it first")
        snapshot = self.full_snapshot()
        with open(path, "wb") as f:
            pickle.dump(snapshot, f, protocol=4)
        return snapshot

    def record_stream(self, tensor, stream: Stream) -> None:
        """Mark ``tensor`` as in use by ``stream``: its block stays ``active_pending_free``
        after it dies, until the work queued on ``stream`` by then has run.

        Args:
            tensor: a tensor on this simulated device.
            stream: the other stream that uses it.

        Raises:
            TypeError: ``tensor`` is not on a simulated device.
            ValueError: ``tensor`` lives on another simulated device.
        """
        storage = self._storage_of(tensor)
        if storage is not None:
            with self.allocator_call():
                self.allocator.record_stream(storage.block, stream.id)

    def data_ptr(self, tensor) -> int:
        """The simulated device address of ``tensor``'s first element.

        Args:
            tensor: a tensor on this simulated device.

        Returns:
            The address, comparable with snapshot block addresses; 0 for an empty tensor.

        Raises:
            TypeError: ``tensor`` is not on a simulated device.
            ValueError: ``tensor`` lives on another simulated device.
        """
        storage = self._storage_of(tensor)
        if storage is None:
            return 0
        inner = tensor.sim_inner
        if self.backed:
            return storage.block.ptr + (inner.data_ptr() - storage.host_ptr)
        return storage.block.ptr + inner.storage_offset() * inner.element_size()

    def external_alloc(self, nbytes: int):
        """Device memory from cudaMalloc itself, outside the caching allocator (static runs).

        Args:
            nbytes: bytes wanted (positive).

        Returns:
            An :class:`~graphborrow.core.device_api.ExternalBuffer`; call its ``free()`` when no
            static run uses it any more.

        Raises:
            ValueError: ``nbytes`` is not positive.
            torch.OutOfMemoryError: the simulated device has not that much free memory.
        """
        if nbytes <= 0:
            raise ValueError(f"external_alloc needs a positive size, got {nbytes}")
        with self._lock:
            address = self.memory.cuda_malloc(nbytes)
        if not address:
            free, total = self.memory.mem_get_info()
            raise self.OutOfMemoryError(
                f"cudaMalloc({nbytes}) failed: out of memory ({free} of {total} bytes free on the simulated device)"
            )
        return ExternalBuffer(address, nbytes, lambda: self.memory.cuda_free(address))

    def describe(self) -> str:
        """The device in words, for tables and plots.

        Returns:
            Capacity, real bytes or layout only (the glossary's words), and the torch version.
        """
        kind = "real bytes" if self.backed else "layout only"
        return f"simulated CUDA device ({self.capacity / GiB:g} GiB, {kind}; torch {torch.__version__})"

    def __repr__(self) -> str:
        return f"SimBackend(capacity={self.capacity}, backed={self.backed}, active={self.is_active})"

    def _storage_of(self, tensor) -> SimStorage | None:
        if not is_sim_tensor(tensor):
            raise TypeError(
                f"expected a tensor on the simulated device, got a plain {tensor.device} tensor; "
                "create it with device='cuda' while the SimBackend is active"
            )
        if tensor.sim_backend is not self:
            raise ValueError("this tensor lives on another simulated device")
        return tensor.sim_storage

    # ------------------------------------------------------ allocation (for tensors)
    @contextlib.contextmanager
    def allocator_call(self) -> Iterator[None]:
        """Serialise allocator calls; frees arriving meanwhile (GC, other threads) wait.

        Each call is a critical section: an interrupt cannot stop the allocator halfway
        through a split, a merge or a free-list update (see :mod:`graphborrow.core.interrupts`).
        The simulator's tensors, graphs and kernels wrap every allocator call in it.

        Returns:
            A context manager; frees deferred while it was held run when the outermost exits.
        """
        if not self._initialised:
            self.initialise()
        with CRITICAL, self._lock:
            if (self._pending or self._dead) and not self._depth:
                self._drain()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            if (self._pending or self._dead) and not self._depth:
                self._drain()

    def new_storage(self, nbytes: int) -> SimStorage:
        """A block from the allocator on the current stream, and the storage that frees it.

        The tensors and kernels of the simulator allocate through this: the block and the
        storage that will free it come into being together, so no interrupt can leak one.

        Args:
            nbytes: bytes requested (the allocator rounds them as torch does).

        Returns:
            The storage; its block goes back to the allocator when the last reference dies.
        """
        self._check_open()
        if not self._initialised:
            self.initialise()
        with CRITICAL:  # the block and the storage that will free it come into being together
            with self._lock:
                if (self._pending or self._dead) and not self._depth:
                    self._drain()
                self._depth += 1
                try:
                    block = self.allocator.malloc(nbytes, self.current_stream().id, threading.get_ident())
                finally:
                    self._depth -= 1
                if self._pending and not self._depth:
                    self._drain()
            try:
                if self.backed:
                    host = self.memory.host_view(block.ptr, nbytes)
                    storage = _BackedStorage(self, block, host, nbytes)
                else:
                    storage = SimStorage(self, block, 0, nbytes, 0)
            except BaseException:
                self.release_block(block, owned=False)  # no storage will ever free it (e.g. memory never mapped)
                raise
            self._owners[block] = _StorageOwner(storage, self._dead.append, block)
        if self._frames is not None:
            stack = traceback.extract_stack(limit=_FRAMES)[:-1]
            self._frames.append([{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(stack)])
        return storage

    def clear_library_workspaces(self) -> None:
        """Release the cuBLAS and cuBLASLt workspaces kept per stream, as ``torch._C._cuda_clearCublasWorkspaces``."""
        self._blas_workspaces.clear()
        self._blaslt_workspaces.clear()

    def ensure_blas_workspace(self) -> None:
        stream = self.current_stream().id
        if stream not in self._blas_workspaces:
            self._blas_workspaces[stream] = self.new_storage(self.blas_workspace)

    def ensure_blaslt_workspace(self) -> None:
        stream = self.current_stream().id
        if stream not in self._blaslt_workspaces:
            self._blaslt_workspaces[stream] = self.new_storage(self.blaslt_workspace)

    def register_generator(self) -> None:
        """A capture registers the RNG's graph-safe seed and offset (two int64 tensors), made by the
        first graph that registers and freed when the last registered graph is reset or deleted."""
        if self._generator_state is None:
            self._generator_state = [self.new_storage(8), self.new_storage(8)]
        self._generator_users += 1

    def unregister_generator(self) -> None:
        """A graph that registered the RNG state went away (see :meth:`register_generator`)."""
        self._generator_users -= 1
        if self._generator_users == 0 and self._generator_state is not None:
            state, self._generator_state = self._generator_state, None
            while state:
                state.pop(0)  # the seed, then the offset

    def release_block(self, block, owned: bool = True) -> None:
        """Free ``block`` for a storage that died (called from its finalizer).

        Args:
            block: the allocator block the storage held.
            owned: whether an owner record was made for it (False only when making the storage failed).

        If an interrupt stops the finalizer before this runs, the storage's owner record
        (a weak reference whose callback is ``list.append``, C code no signal can split
        from the death) still reaches ``_dead``, and the next allocator call frees it. The
        same happens when a garbage collection finds storages in a cycle: their weak references
        are cleared before the finalizers run, so a free in between may already have freed this
        block through its record (and merged it into a neighbour); then there is nothing to free.
        """
        if self._closed:
            return
        with CRITICAL, self._lock:
            if self._owners.pop(block, None) is None and owned:
                return  # freed already, through its owner record
            if self._depth:
                self._pending.append(block)
                return
            self._depth += 1
            try:
                self.allocator.free(block)
            finally:
                self._depth -= 1
            if self._pending or self._dead:
                self._drain()

    def _drain(self) -> None:
        self._depth += 1
        try:
            while self._pending:
                self.allocator.free(self._pending.pop(0))
            dead, owners = self._dead, self._owners
            while dead:
                owner = dead.pop()
                if owners.get(owner.block) is owner:  # its storage died but never freed it
                    del owners[owner.block]
                    self.allocator.free(owner.block)
        finally:
            self._depth -= 1

    def place(self, src: torch.Tensor, copy: bool = True) -> SimTensor:
        """A new device tensor with ``src``'s layout (its storage size, strides, offset).

        Args:
            src: a CPU (or META) tensor whose layout, and with ``copy`` values, are taken.
            copy: copy ``src``'s values in (ignored on a layout-only device).

        Returns:
            A :class:`~graphborrow.sim.tensor.SimTensor` in a block allocated on the
            current stream, routed like any other allocation.
        """
        nbytes = src.untyped_storage().nbytes()
        if nbytes == 0:
            return SimTensor(src, None, self)
        storage = self.new_storage(nbytes)
        if not self.backed:  # src itself is the inner tensor: META (layout) or CPU (small, with values)
            storage.key = src.untyped_storage()._cdata
            storage.values = not src.is_meta
            return SimTensor(src, storage, self)
        inner = storage.host.view(src.dtype).as_strided(
            src.size(), src.stride(), storage.host.storage_offset() // src.element_size() + src.storage_offset()
        )
        if copy:
            inner.copy_(src)
        return SimTensor(inner, storage, self)

    def deep_copy(self, tensor: SimTensor, memo: dict) -> SimTensor:
        """A new tensor with ``tensor``'s layout in a copy of its whole storage (``copy.deepcopy``).

        Args:
            tensor: a tensor on this device.
            memo: the deepcopy's memo; tensors of one storage copied in it share the copy.

        Returns:
            The copy, in a new block of the storage's size on the current stream.
        """
        inner, storage = tensor.sim_inner, self._storage_of(tensor)
        if storage is None:
            return SimTensor(inner.clone(), None, self)
        key = ("graphborrow.sim storage", id(storage))
        copied = memo.get(key)
        if copied is None:
            fresh = self.new_storage(storage.nbytes)
            if self.backed:
                fresh.host.copy_(storage.host)
                base = None
            else:
                source = inner.untyped_storage()
                base = source.clone() if not inner.is_meta else torch.UntypedStorage(source.nbytes(), device="meta")
                fresh.key, fresh.values = base._cdata, storage.values and not inner.is_meta
            copied = memo[key] = (fresh, base)
            memo.setdefault(id(memo), []).append(storage)  # keeps the id unique while the memo lives
        fresh, base = copied
        if self.backed:
            itemsize = inner.element_size()
            offset = fresh.host.storage_offset() // itemsize + (inner.data_ptr() - storage.host_ptr) // itemsize
            view = fresh.host.view(inner.dtype).as_strided(inner.size(), inner.stride(), offset)
        else:
            view = torch.empty(0, dtype=inner.dtype, device=inner.device).set_(base, inner.storage_offset(),
                                                                              inner.size(), inner.stride())
        return SimTensor(view, fresh, self)

    def from_host(self, host: torch.Tensor) -> SimTensor:
        """Copy a plain CPU tensor onto the device (``.to("cuda")``).

        Args:
            host: a CPU tensor; a tensor already on a simulated device is given back as is.

        Returns:
            A :class:`~graphborrow.sim.tensor.SimTensor` with ``host``'s shape, strides and values.
        """
        if is_sim_tensor(host):
            return host
        with torch_functions_off():
            if not self.backed and keeps_values(host):  # layout only, small: it keeps its values
                layout = torch.empty_like(host)
                layout.copy_(host)
                return self.place(layout, copy=False)
            layout = torch.empty_like(host, device="meta")
        placed = self.place(layout, copy=False)
        if self.backed:
            placed.sim_inner.copy_(host)
        return placed


class _StorageOwner(weakref.ref):
    """A weak reference to a storage that remembers its block (see ``SimBackend.release_block``)."""

    __slots__ = ("block",)

    def __new__(cls, storage, callback, block):
        self = super().__new__(cls, storage, callback)
        self.block = block
        return self

    def __init__(self, storage, callback, block) -> None:
        super().__init__(storage, callback)


class _BackedStorage(SimStorage):
    __slots__ = ("host",)

    def __init__(self, backend, block, host: torch.Tensor, nbytes: int) -> None:
        super().__init__(backend, block, host.data_ptr(), nbytes, 0)
        self.host = host
        self.values = True
