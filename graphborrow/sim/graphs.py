"""CUDA graphs on the simulated device: capture records ops, replay re-runs them in place.

Capture follows ``torch.cuda.graph``: synchronise, empty the cache, switch to a side
stream, route that stream's allocations to the graph's private pool
(``begin_allocate_to_pool`` with a stream filter). Every op run on the capturing stream
is recorded with the CPU views of the memory it reads and writes; ``replay()`` runs the
ops again and copies fresh results into the recorded output addresses. Nothing keeps
the captured tensors alive, just as on CUDA: a tensor later placed in a freed block of
the pool really is overwritten by the next replay.
"""

from __future__ import annotations

import gc

import torch

from .host import CAPTURE_INVALIDATED
from .torch_function import torch_functions_off

__all__ = ["CUDAGraph", "CaptureRegistry", "graph"]

_REPLAY_SKIPS: dict = {}  # op -> True when it neither writes memory nor makes fresh outputs


class CaptureRegistry:
    """The captures under way on one simulated device: capturing stream id -> its graph.

    Only :class:`CUDAGraph` begins and ends captures; the device and its tensors ask which
    graph (if any) the current stream is capturing into.
    """

    def __init__(self) -> None:
        self._by_stream: dict[int, CUDAGraph] = {}

    def __bool__(self) -> bool:
        return bool(self._by_stream)

    def graph_on(self, stream_id: int) -> "CUDAGraph | None":
        """The graph capturing on this stream (the stream its capture began on, or one that joined the
        capture by waiting on an event recorded in it), or None."""
        found = self._by_stream.get(stream_id)
        if found is not None or not self._by_stream:
            return found
        for cuda_graph in self._by_stream.values():
            stream = cuda_graph._backend.clock.streams.get(stream_id)
            if stream is not None and stream.capture is not None and stream.capture is cuda_graph._capture:
                return cuda_graph
        return None

    def _begin(self, stream_id: int, cuda_graph: "CUDAGraph") -> None:
        if stream_id in self._by_stream:
            raise RuntimeError(f"stream {stream_id} is already capturing another graph; end that capture first")
        self._by_stream[stream_id] = cuda_graph

    def _end(self, stream_id: int) -> None:
        self._by_stream.pop(stream_id, None)


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` for a :class:`~graphborrow.sim.device.SimBackend`; create with ``backend.CUDAGraph()``."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self._ops: list[tuple] = []
        self._written: list[tuple[int, int]] = []
        self._pool: tuple[int, int] | None = None
        self._stream = None
        self._capturing = False
        self._captured = False
        self._holds_pool = False
        self._invalidated = False
        self._registered = False  # holds a registration of the RNG state
        self._capture = None  # the stream capture's graph (allocator.capture.CaptureGraph) while capturing
    def invalidate(self) -> None:
        """A host wait happened inside the capture: CUDA invalidates it, and ending it fails."""
        self._invalidated = True

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        backend = self._backend
        if self._captured or self._capturing:
            raise RuntimeError(
                "This CUDAGraph instance already owns a captured graph. To capture a new graph, "
                "create a new instance or call reset() first."
            )
        stream = backend.current_stream()
        if stream.id == 0:
            raise RuntimeError(
                "CUDA graphs must be captured on a non-default stream. (However, after capture, "
                "it's ok to replay them on the default stream.) Use backend.graph(g) or "
                "`with backend.stream(backend.Stream()):`."
            )
        if backend.captures.graph_on(stream.id) is not None:
            raise RuntimeError(f"stream {stream.id} is already capturing another graph; end that capture first")
        pool_id = backend.new_pool_id(graph=True) if pool is None else backend.pool_id(pool)
        sid = stream.id
        backend.register_generator()  # before routing starts: lands in the default pool
        self._registered = True
        capture = self._capture = backend.clock.begin_capture(stream)
        streams = backend.clock.streams

        def routed(s, thread):  # every stream in the capture (CUDAGraph's filter compares capture ids)
            found = streams.get(s)
            return found is not None and found.capture is capture

        try:
            with backend.allocator_call():
                backend.allocator.begin_allocate_to_pool(pool_id, routed)
        except BaseException:
            backend.clock.end_capture(capture)
            raise
        self._pool = pool_id
        self._holds_pool = True
        self._stream = stream
        self._capturing = True
        backend.captures._begin(sid, self)

    def capture_end(self) -> None:
        backend = self._backend
        if not self._capturing:
            raise RuntimeError("capture_end() without a matching capture_begin()")
        if backend.current_stream() is not self._stream:
            raise RuntimeError(
                f"Capture must end on the same stream it began on (began on stream {self._stream.id}, "
                f"current stream is {backend.current_stream().id})"
            )
        backend.captures._end(self._stream.id)
        backend.clock.end_capture(self._capture)
        self._capturing = False
        with backend.allocator_call():
            backend.allocator.end_allocate_to_pool(self._pool)
        if self._invalidated:  # cudaStreamEndCapture reports the earlier error; nothing was captured
            self._invalidated = False
            self._ops, self._written = [], []
            raise torch.AcceleratorError(CAPTURE_INVALIDATED)
        self._captured = True

    def replay(self) -> None:
        """Re-run the captured ops, writing into the addresses captured."""
        if not self._captured:
            raise RuntimeError("Called CUDAGraph.replay() without a preceding successful capture.")
        backend = self._backend
        if backend.capture_for_current_stream() is not None:
            raise RuntimeError("cannot replay a graph while the current stream is capturing another one")
        with torch_functions_off(), torch.inference_mode():
            for func, args, kwargs, fresh in self._ops:
                out = func(*args, **kwargs)
                for index, view, geometry in fresh:
                    if (tuple(view.shape), view.stride(), view.storage_offset()) != geometry:
                        view = view.as_strided(*geometry)  # an in-place view op (squeeze_) reshaped it since
                    view.copy_(out if index < 0 else out[index])

    def reset(self) -> None:
        """Drop the recorded work and release the pool (``releasePool``), like torch."""
        if self._capturing:
            raise RuntimeError("cannot reset() a graph while it is capturing; leave the capture first")
        self._ops = []
        self._written = []
        self._captured = False
        if self._registered and not self._backend.closed:
            self._registered = False
            self._backend.unregister_generator()
        if self._holds_pool:
            self._holds_pool = False
            backend = self._backend
            if not backend.closed:
                with backend.allocator_call():
                    backend.allocator.release_pool(self._pool)

    def pool(self) -> tuple[int, int]:
        """The private pool id, to share with later captures (``pool=g.pool()``)."""
        if self._pool is None:
            raise RuntimeError("Called CUDAGraph.pool() without a preceding capture_begin().")
        return self._pool

    def written_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every tensor the captured ops created, merged and sorted:
        the device bytes a replay writes (what an escaped borrow there would lose). Known on
        a layout-only device too, where no ops are recorded."""
        merged: list[list[int]] = []
        for start, nbytes in sorted(self._written):
            end = start + nbytes
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(a, b - a) for a, b in merged]

    @property
    def num_ops(self) -> int:
        return len(self._ops)

    def record_written(self, ranges) -> None:
        """Note ``(address, nbytes)`` ranges that a captured op's new outputs occupy."""
        self._written.extend(ranges)

    def record_op(self, func, args, kwargs, fresh: list) -> None:
        """Keep a captured op for replay (ops that neither create nor mutate are skipped, and so are
        in-place view ops such as ``squeeze_``: they change no bytes). Each new output keeps its
        geometry as made, for a later in-place view op changes the tensor's own."""
        if torch.Tag.inplace_view in getattr(func, "tags", ()):
            return
        fresh = [(index, view, (tuple(view.shape), view.stride(), view.storage_offset())) for index, view in fresh]
        if not fresh:
            skip = _REPLAY_SKIPS.get(func)
            if skip is None:
                schema = getattr(func, "_schema", None)
                skip = schema is not None and not schema.is_mutable
                _REPLAY_SKIPS[func] = skip
            if skip:
                return
        self._ops.append((func, args, kwargs, fresh))

    def __del__(self) -> None:
        try:
            if not self._capturing:
                self.reset()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else "captured" if self._captured else "empty"
        return f"CUDAGraph({state}, pool={self._pool}, ops={len(self._ops)})"


class graph:
    """``torch.cuda.graph`` for the simulated device (``backend.graph(g, pool, stream)``)."""

    def __init__(self, cuda_graph: CUDAGraph, pool=None, stream=None, capture_error_mode: str = "global") -> None:
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(
                f"expected a simulated CUDAGraph from backend.CUDAGraph(), got {type(cuda_graph).__name__}"
            )
        backend = cuda_graph._backend
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.capture_stream = stream if stream is not None else backend.default_capture_stream()
        self._stream_ctx = backend.stream(self.capture_stream)

    def __enter__(self) -> None:
        backend = self.cuda_graph._backend
        backend.synchronize()
        gc.collect()  # torch.cuda.graph collects first, so garbage in cycles frees before the capture
        backend.empty_cache()
        self._stream_ctx.__enter__()
        try:
            self.cuda_graph.capture_begin(self.pool)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.cuda_graph.capture_end()
        finally:
            self._stream_ctx.__exit__(*exc)
