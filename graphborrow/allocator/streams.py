"""Simulated CUDA streams: each stream has a clock, work takes time, events complete late.

Times are microseconds. A stream's ``queued_until`` is when the work enqueued so far
finishes; its ``clock`` is how far it has executed. ``Clockwork.advance`` lets every
stream execute for a while (the host doing something else), ``synchronize`` waits for one
stream (only that stream catches up). An event recorded on a stream completes once that
stream's clock reaches the point where the event was recorded. This is all the caching
allocator needs to model ``record_stream`` and deferred frees. While a stream captures a CUDA
graph it carries that capture's :class:`~graphborrow.allocator.capture.CaptureGraph`: kernels
become nodes, an event recorded there keeps the stream's terminal nodes, and a stream that
waits on it joins the capture.
"""

from __future__ import annotations

from .capture import CaptureGraph

__all__ = ["Clockwork", "Event", "Stream"]


class Stream:
    """One simulated stream; ``id`` 0 is the default stream (torch reports streams as ints)."""

    __slots__ = ("id", "priority", "queued_until", "clock", "capture", "_clockwork")

    def __init__(self, stream_id: int, clockwork: "Clockwork", priority: int = 0) -> None:
        self.id = stream_id
        self.priority = priority  # accepted for API parity, ignored like the allocator does
        self.queued_until = 0.0
        self.clock = 0.0
        self.capture = None  # the CaptureGraph this stream is capturing into, if any
        self._clockwork = clockwork

    def launch(self) -> None:
        """A kernel was launched on this stream: a node of its capture's graph, when it captures."""
        if self.capture is not None:
            self.capture.launch(self.id)

    def enqueue(self, microseconds: float) -> None:
        """Make the stream busy for ``microseconds`` more (like ``torch.cuda._sleep``)."""
        if microseconds < 0:
            raise ValueError(f"cannot enqueue negative work ({microseconds} µs); pass a duration >= 0")
        self.queued_until = max(self.queued_until, self.clock) + microseconds

    def synchronize(self) -> None:
        """Host waits until this stream has run everything enqueued on it."""
        if self.queued_until > self.clock:
            self._clockwork._host_waited(self.queued_until - self.clock)
            self.clock = self.queued_until

    def query(self) -> bool:
        """True when the stream is idle."""
        return self.clock >= self.queued_until

    def wait_event(self, event: "Event") -> None:
        """Later work on this stream starts only after ``event`` (cudaStreamWaitEvent); an event
        recorded in a capture makes this stream join it, after the nodes the event recorded."""
        capture = event.capture
        if capture is not None and capture.active:
            capture.join(self.id, event.nodes)
            self.capture = capture
        if event.marker is not None and event.stream is not None:
            # translate the other stream's remaining work into this stream's time line
            remaining = max(0.0, event.marker - event.stream.clock)
            self.queued_until = max(self.queued_until, self.clock + remaining)

    def wait_stream(self, other: "Stream") -> None:
        event = Event()
        event.record(other)
        self.wait_event(event)

    def __repr__(self) -> str:
        return f"Stream(id={self.id}, clock={self.clock:g}, queued_until={self.queued_until:g})"


class Event:
    """A marker in one stream's work; completes when the stream's clock passes it."""

    __slots__ = ("stream", "marker", "capture", "nodes")

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.marker: float | None = None
        self.capture = None  # recorded in a capture: its graph, and the stream's terminal nodes then
        self.nodes: tuple[int, ...] = ()

    def record(self, stream: Stream) -> None:
        self.stream = stream
        self.marker = stream.queued_until
        self.capture = stream.capture
        self.nodes = stream.capture.terminals.get(stream.id, ()) if stream.capture is not None else ()

    def query(self) -> bool:
        """True once the recorded work is done (an unrecorded event counts as done, like CUDA)."""
        return self.stream is None or self.stream.clock >= self.marker

    def synchronize(self) -> None:
        """Host waits until the event completes."""
        stream = self.stream
        if stream is not None and stream.clock < self.marker:
            stream._clockwork._host_waited(self.marker - stream.clock)
            stream.clock = self.marker

    def __repr__(self) -> str:
        return f"Event(stream={None if self.stream is None else self.stream.id}, marker={self.marker})"


class Clockwork:
    """Owns the streams of one simulated device and the host's notion of time."""

    def __init__(self) -> None:
        self._host_us = 0.0
        self.default_stream = Stream(0, self)
        self.streams: dict[int, Stream] = {0: self.default_stream}
        self._captures = 0

    def begin_capture(self, stream: Stream) -> CaptureGraph:
        """``cudaStreamBeginCapture`` on ``stream``: a new graph, with no nodes yet."""
        self._captures += 1
        graph = CaptureGraph(self._captures)
        graph.join(stream.id)
        stream.capture = graph
        return graph

    def end_capture(self, graph: CaptureGraph) -> None:
        """``cudaStreamEndCapture``: every stream that joined the capture stops capturing."""
        graph.active = False
        for stream_id in graph.streams():
            stream = self.streams.get(stream_id)
            if stream is not None and stream.capture is graph:
                stream.capture = None

    def new_stream(self, stream_id: int | None = None, priority: int = 0) -> Stream:
        """A new stream with the next free id (1, 2, ...), or exactly ``stream_id``."""
        if stream_id is None:
            stream_id = max(self.streams) + 1
        elif stream_id in self.streams:
            raise ValueError(f"stream id {stream_id} is already in use; omit stream_id to get a fresh one")
        stream = Stream(stream_id, self, priority)
        self.streams[stream_id] = stream
        return stream

    def stream(self, stream_id: int) -> Stream:
        """The stream with this id, created on first use (allocator calls pass plain ids)."""
        stream = self.streams.get(stream_id)
        if stream is None:
            stream = self.new_stream(stream_id)
        return stream

    def advance(self, microseconds: float) -> None:
        """Every stream executes for ``microseconds`` while the host does something else."""
        if microseconds < 0:
            raise ValueError(f"time only moves forward; got advance({microseconds})")
        self._host_us += microseconds
        for stream in self.streams.values():
            stream.clock += microseconds

    def synchronize(self) -> None:
        """Device-wide synchronize: the host waits for the busiest stream, every stream catches up."""
        wait = max(max(s.queued_until - s.clock, 0.0) for s in self.streams.values())
        self.advance(wait)

    def _host_waited(self, microseconds: float) -> None:
        self._host_us += microseconds

    @property
    def now_us(self) -> float:
        """Host time in µs; monotone, used for trace ``time_us``."""
        return self._host_us
