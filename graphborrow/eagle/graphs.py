"""Verification steps captured in CUDA graphs for eager callers: capture on first use, replay after.

``eagle_verify(..., graph=True)`` looks the call up in :data:`GRAPH_STEPS`. The first call
with a given key runs the step eagerly (compiling its kernels; that call's result is real),
then captures the same step into a CUDA graph; every later call with that key replays the
graph (``CUDAGraph.replay``): no Python work per kernel. Either implementation can be
captured: the fused kernel (its entry then owns the step's counters, so its graph is the
kernel alone) or the reference. Serving engines pass the same logits, tree and coin
buffers every step, so their key repeats and no copy is needed.

The key, what an entry holds, how to clear it and why a call inside a caller's capture is
refused: ``docs/kernels.md``, "The graph path".
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import torch

from . import modes
from .scope import run_borrowing
from .step import VerifyResult, VerifyStep
from .triton import fused
from .triton.runtime import capturing_now

__all__ = ["GRAPH_STEPS", "GraphSteps", "clear_verify_graphs"]

MAX_ENTRIES = 8
# Why graph=True is refused while the current stream captures a graph: an entry's graph would
# become part of the caller's, reading workspace memory the entry's pool may hand to another
# entry once it is dropped
INSIDE_A_CAPTURE = ("eagle_verify(graph=True) was called while the current stream captures a CUDA graph; its entries "
                    "are graphs of their own, which cannot go inside another: inside a capture call eagle_verify "
                    "without graph=True (validate=False), and the step is captured into your graph")


class _Entry:
    """One captured step: the graph, its outputs, and what it was captured from."""

    __slots__ = ("graph", "out", "step", "borrow", "counters")

    def __init__(self, graph, out: VerifyResult, step: VerifyStep, borrow, counters):
        self.graph, self.out, self.step, self.borrow, self.counters = graph, out, step, borrow, counters

    def replay(self, validate: bool) -> VerifyResult:
        if validate:
            self.step.validate()  # (the captured tensors: the same memory as the call's)
        if capturing_now():
            raise ValueError(INSIDE_A_CAPTURE)
        if self.borrow is None:
            self.graph.replay()
        else:
            with self.borrow.replay_scope():
                self.graph.replay()
        return self.out


class _LastCall:
    """The previous call's argument objects and the entry they found: a call passing the
    very same objects (the tree still holding the same tables, every tensor still at its
    address) finds it without a key. The checks are C-level passes (``map``), not a Python
    loop: they are the serving loop's whole host work before the replay."""

    __slots__ = ("args", "index", "next_token", "next_sibling", "tensors", "pointers", "entry")

    def __init__(self, args: tuple, entry: _Entry):
        self.args, self.entry = args, entry
        tables = _tables(args[2])
        self.index, self.next_token, self.next_sibling = tables
        self.tensors = [t for t in (args[0], args[1], *tables, *args[3:8]) if isinstance(t, torch.Tensor)]
        self.pointers = list(map(_DATA_PTR, self.tensors))

    def finds(self, args: tuple) -> bool:
        tree = args[2]
        return (all(map(operator.is_, args, self.args)) and tree.retrive_index is self.index
                and tree.retrive_next_token is self.next_token and tree.retrive_next_sibling is self.next_sibling
                and list(map(_DATA_PTR, self.tensors)) == self.pointers)


_DATA_PTR = torch.Tensor.data_ptr


def _tables(tree) -> tuple:
    """The tree's three tables (the objects, not copies)."""
    return tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling


class GraphSteps:
    """A small cache of verification steps captured in CUDA graphs (see the module docstring).

    Args:
        max_entries: most graphs kept; the least recently used goes first.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self.entries: OrderedDict = OrderedDict()
        self.captures = 0  # graphs captured so far (a test and a benchmark read it)
        self._last: _LastCall | None = None
        self._pools: dict = {}  # device index -> the private pool the entries without a borrow share

    def last(self, call: tuple) -> _Entry | None:
        """The previous call's entry when ``call`` passes the very same objects, its tensors
        still at their addresses (no key is built); else None."""
        last = self._last
        return last.entry if last is not None and last.finds(call) else None

    def verify(self, call: tuple, step: VerifyStep, impl: str, mode: str, per_chunk, borrow,
               validate: bool) -> VerifyResult:
        """:func:`~graphborrow.eagle.eagle_verify` with ``graph=True`` for a checked (and, if
        asked, validated) ``step`` of ``call``'s arguments: replay the entry of its key, or run
        the step eagerly and capture it. ``impl``: ``"fused"`` or ``"reference"`` (in ``mode``,
        ``per_chunk`` requests per group); ``borrow``: an enabled borrow state or None.

        Returns:
            The entry's outputs (rewritten by its next replay).

        Raises:
            ValueError: a call the graph path cannot take (tensors not on a CUDA device, a
                generator with missing coins, a stream capturing a graph).
        """
        key = (_tensor_key(step.logits), _tensor_key(step.candidates), *map(_tensor_key, _tables(step.tree)),
               step.tree_depth, _param_key(step.temperatures), _param_key(step.top_ks), _param_key(step.top_ps),
               _tensor_key(step.coins), _tensor_key(step.coins_final), step.threshold_single, step.threshold_acc,
               impl, mode if impl == "reference" else None, per_chunk, id(borrow) if borrow is not None else None)
        entry = self.entries.get(key)
        if entry is None:
            out = self._capture(key, step, impl, mode, per_chunk, borrow)
            entry = self.entries.get(key)
        else:
            self.entries.move_to_end(key)
            out = entry.replay(False)  # (validated by the caller)
        self._last = None if entry is None else _LastCall(call, entry)
        return out

    def _capture(self, key, step: VerifyStep, impl: str, mode: str, per_chunk, borrow) -> VerifyResult:
        if not step.logits.is_cuda or not torch.cuda.is_available():
            raise ValueError(f"graph=True replays the step from a CUDA graph: it needs CUDA logits (got "
                             f"{step.logits.device}); call without graph=True elsewhere")
        if capturing_now():
            raise ValueError(INSIDE_A_CAPTURE)
        if step.generator is not None and (step.coins is None or step.coins_final is None):
            raise ValueError("graph=True draws missing coins inside the graph from the default CUDA generator; pass "
                             "coins and coins_final, or generator=None")
        if impl == "fused":
            out = fused.allocate_outputs(step)
            if step.batch_size == 0:
                return out
            counters = fused.step_counters(step)  # the entry's own: the graph needs no zeroing node

            def run(borrowing):
                run_borrowing(borrowing, fused.run_step, step, out, True, counters)
        else:
            out, counters = modes.allocate_outputs(step), None

            def run(borrowing):
                modes.run_into(step, out, borrowing, mode, per_chunk or max(step.batch_size, 1))
        run(borrow)  # the first call's result (kernels compiled before the capture)
        graph = torch.cuda.CUDAGraph()
        if borrow is None:
            with torch.cuda.graph(graph, pool=self._pool(step.logits.get_device())):
                run(None)
        else:  # the captured step's temporaries take the borrow state's graph pool, as its graphs' do
            with borrow.capture_scope(), borrow.backend.graph(graph, pool=borrow.pool_id):
                run(None)
        if len(self.entries) >= self.max_entries:
            self.entries.popitem(last=False)
            self._last = None  # (it may hold the entry that goes)
        self.entries[key] = _Entry(graph, out, step, borrow, counters)
        self.captures += 1
        return out

    def _pool(self, device: int):
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = torch.cuda.graph_pool_handle()
        return pool

    def held_bytes(self) -> int:
        """Bytes of the entries' outputs and counters (their graphs' workspace lives in the graph pool).

        Returns:
            The sum over entries of their three output tensors' and their counters' bytes.
        """
        return sum(t.numel() * t.element_size() for e in self.entries.values()
                   for t in (*e.out, *(() if e.counters is None else (e.counters,))))

    def clear(self) -> None:
        """Drop every entry: its graph, outputs and references to the tensors it was captured from."""
        self.entries.clear()
        self._pools.clear()
        self._last = None


GRAPH_STEPS = GraphSteps()


def clear_verify_graphs() -> None:
    """Drop every captured verification step of ``eagle_verify(..., graph=True)``.

    ``torch.cuda.empty_cache()`` afterwards returns the private graph pool's memory.
    """
    GRAPH_STEPS.clear()


def _tensor_key(t):
    """What a captured launch bakes in of a tensor argument (None stays None)."""
    if t is None:
        return None
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _param_key(value):
    """A number keys by its value (it is baked into the graph), a tensor by its memory."""
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    return value
