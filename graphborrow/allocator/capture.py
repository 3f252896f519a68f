"""A CUDA stream capture's graph as the caching allocator sees it: nodes, edges, each stream's terminals.

While a stream captures, every kernel launched on it (or on a stream that joined the capture
by waiting on an event recorded in it) becomes a node whose dependencies are that stream's
current *terminal* nodes, and then the stream's only terminal. An event recorded in the
capture remembers its stream's terminals; a stream that waits on it joins the capture (if it
was not in it) and adds them to its own. That is all ``cudaStreamGetCaptureInfo`` tells the
allocator, and all ``graph_capture_record_stream_reuse`` reads: a block freed after
``record_stream`` keeps its streams' terminals as *free markers*, and becomes reusable on its
stream once every marker precedes (or is) one of that stream's terminals.
"""

from __future__ import annotations

__all__ = ["CaptureGraph"]


class CaptureGraph:
    """The graph one capture is building (``capture_id`` as CUDA numbers captures)."""

    __slots__ = ("capture_id", "parents", "terminals", "active", "_seen")

    def __init__(self, capture_id: int) -> None:
        self.capture_id = capture_id
        self.active = True  # False once the capture ended: its events no longer join streams
        self.parents: list[tuple[int, ...]] = []  # node -> the nodes it depends on
        self.terminals: dict[int, tuple[int, ...]] = {}  # stream id -> its terminal nodes
        self._seen: dict[int, set[int]] = {}  # stream id -> nodes known to precede its terminals

    def join(self, stream_id: int, nodes: tuple[int, ...] = ()) -> None:
        """``stream_id`` depends on ``nodes`` from now on (it joins the capture if it was not in it)."""
        known = self.terminals.get(stream_id, ())
        self.terminals[stream_id] = tuple(dict.fromkeys(known + tuple(nodes)))

    def launch(self, stream_id: int) -> int:
        """A kernel on ``stream_id``: a node after the stream's terminals, then its only terminal."""
        node = len(self.parents)
        self.parents.append(self.terminals.get(stream_id, ()))
        self.terminals[stream_id] = (node,)
        return node

    def streams(self) -> list[int]:
        """The streams in the capture."""
        return list(self.terminals)

    def preceding(self, stream_id: int) -> set[int]:
        """Every node that is, or precedes, one of ``stream_id``'s terminals (``update_visited``: a
        walk back from the terminals that stops at nodes already seen for this stream)."""
        seen = self._seen.setdefault(stream_id, set())
        todo = list(self.terminals.get(stream_id, ()))
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(self.parents[node])
        return seen

    def __repr__(self) -> str:
        return f"CaptureGraph(id={self.capture_id}, nodes={len(self.parents)}, streams={self.streams()})"
