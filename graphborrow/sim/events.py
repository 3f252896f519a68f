"""Events and the current-stream block of the simulated device, as ``torch.cuda.Event`` and
``torch.cuda.stream(s)`` behave on the GPU (the streams' clocks are :mod:`graphborrow.allocator.streams`)."""

from __future__ import annotations

from graphborrow.allocator.streams import Event, Stream

__all__ = ["SimEvent", "StreamContext"]


class SimEvent:
    """``torch.cuda.Event`` on the simulated device (records on the current stream by default)."""

    def __init__(self, backend: "graphborrow.sim.device.SimBackend") -> None:
        self._backend = backend
        self._event = Event()

    def record(self, stream: Stream | None = None) -> None:
        """Mark the point reached by the work queued on ``stream`` so far.

        Args:
            stream: the stream to record on; None for the current stream.
        """
        self._event.record(stream if stream is not None else self._backend.current_stream())

    def query(self) -> bool:
        """Whether the recorded point has run, without waiting.

        Returns:
            True once the stream's clock has passed the point (or nothing was recorded).
        """
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def wait(self, stream: Stream | None = None) -> None:
        """Make later work on ``stream`` wait for this event (no host wait).

        Args:
            stream: the waiting stream; None for the current stream.
        """
        (stream if stream is not None else self._backend.current_stream()).wait_event(self._event)


class StreamContext:
    """``with backend.stream(s):``: ``s`` is this thread's current stream inside the block."""

    __slots__ = ("backend", "stream", "saved")

    def __init__(self, backend: "graphborrow.sim.device.SimBackend", stream: Stream | None) -> None:
        self.backend = backend
        self.stream = stream

    def __enter__(self):
        tls = self.backend._tls
        self.saved = getattr(tls, "stream", None)
        if self.stream is not None:
            tls.stream = self.stream
        return self.stream

    def __exit__(self, *exc) -> None:
        self.backend._tls.stream = self.saved
