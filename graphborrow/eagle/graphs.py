"""Verification steps captured in CUDA graphs for eager callers: capture on first use, replay after.

(Imported on first use by :func:`~graphborrow.eagle.eagle_verify`: it imports triton.)

``eagle_verify(..., graph=True)`` looks the call up in :data:`GRAPH_STEPS`. The first call
with a given key runs the fused step eagerly (compiling its kernels; that call's result
is real), then captures the same step into a CUDA graph; every later call with that key
replays the graph: one launch, no Python work per kernel. Serving engines pass the same
logits, tree and coin buffers every step, so their key repeats and no copy is needed. An
entry whose graph draws no random numbers (both coins given) launches the graph's executable
directly (:func:`.triton.direct.graph_launch`, ``cuGraphLaunch``), which costs the host
less than ``CUDAGraph.replay``; ``GRAPHBORROW_DIRECT_LAUNCH=0`` keeps ``replay`` for all.

**The key** is everything a captured launch bakes in: the address, shape, strides and
dtype of every tensor argument (logits, candidates, the three tree tables, coins, and
temperature / top-k / top-p when given as tensors), the value of every parameter given
as a number, the thresholds, the tree depth, and the borrow state. A call that differs in
any of them — a buffer reallocated, a batch of another size, a new temperature number —
is another key: it captures another graph. Values *inside* the tensors are not part of
the key: a replay reads whatever the buffers hold then. A call passing the very objects of
the previous call, its tensors still at their addresses, finds that entry without
building the key (the common serving loop); a tensor whose storage is swapped in place
(``set_``, ``resize_``) at the same address and object is not noticed: keep graph inputs
static, as for any CUDA graph.

**What an entry holds**: its graph; its outputs (``predicts``, ``accept_index``,
``accept_length``, about ``4 * bs * (D + S + 1)`` bytes), which every replay rewrites, so
a caller copies what it keeps before the next call with the same key; the step's counters
(``4 * (2 * bs * D + 3 * bs)`` bytes and a few more, outside the graph pool:
:func:`~graphborrow.eagle.triton.fused.step_counters`), which the kernel leaves zeroed, so the
graph is the kernel alone, without the zeroing node a step captured by hand replays before
it; and references to the tensors it was captured with (their memory
must outlive the graph, which reads it). Entries do share the pool's memory (one entry's
workspace is where another's was), so, as for any graphs sharing a pool, replay them one
after another, not at once on two streams.
The workspace (a few KiB to about 9 MiB with top-k / top-p at bs 128 x D 16) lives in the
graph pool the entries share: one private pool per device, or, with an enabled
``borrow``, the borrow state's graph pool itself (the capture runs in its
``capture_scope``, replays in its ``replay_scope``), where it takes idle blocks like any
other captured graph's temporaries. :meth:`GraphSteps.held_bytes` reports the outputs'
bytes; the private pool's segments show in ``torch.cuda.memory_snapshot``.

**Inside a capture** ``graph=True`` is refused (ValueError, naming the fix): an entry's graph
launched into the caller's capture would become part of the caller's graph and read
workspace memory that the entries' pool gives to another entry once this one is dropped.
Inside a capture, call without ``graph=True``: the step is captured into the caller's graph.

**Clearing**: :func:`clear_verify_graphs` drops every entry (``torch.cuda.empty_cache()``
then returns the private pool's memory); the cache keeps at most ``max_entries`` (8),
dropping the least recently used. Missing coins are drawn inside the graph from the
default CUDA generator (graph-safe); a custom ``generator`` with missing coins is refused.
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import torch

from .modes import VerifyResult
from .scope import run_borrowing
from .step import VerifyStep
from .triton import direct, fused
from .triton.launch import capturing_now, current_stream, direct_disabled
from .verify import resolve_impl

__all__ = ["GRAPH_STEPS", "GraphSteps", "clear_verify_graphs"]

MAX_ENTRIES = 8


class _Entry:
    """One captured step: the graph, its outputs, and what it was captured from.

    ``executable``: the graph's executable, launched directly (:func:`.direct.graph_launch`)
    in place of ``CUDAGraph.replay`` when the graph draws no random numbers (the call gave
    both coins), so no generator offset needs advancing; None: ``replay``.
    """

    __slots__ = ("graph", "out", "step", "borrow", "counters", "executable", "device")

    def __init__(self, graph, out: VerifyResult, step: VerifyStep, borrow, counters: torch.Tensor):
        self.graph, self.out, self.step, self.borrow, self.counters = graph, out, step, borrow, counters
        self.device = step.logits.get_device()
        self.executable = _direct_executable(graph, step)

    def replay(self, validate: bool) -> VerifyResult:
        if validate:
            self.step.validate()  # (the captured tensors: the same memory as the call's)
        if self.borrow is None:
            self.launch()
        else:
            with self.borrow.replay_scope():
                self.launch()
        return self.out

    def launch(self) -> None:
        if self.executable is None:
            if capturing_now():
                raise ValueError(INSIDE_A_CAPTURE)
            self.graph.replay()
        else:  # (the direct launch refuses a capturing stream itself, naming INSIDE_A_CAPTURE's fix)
            _GRAPH_LAUNCH(self.executable, current_stream(self.device), self.device)


def _direct_executable(graph, step: VerifyStep):
    """The graph's executable for direct launches, or None where ``replay`` must run it: coins
    drawn inside the graph (``replay`` advances the generator's offset), the direct module
    not built, this torch without ``raw_cuda_graph_exec``, or ``GRAPHBORROW_DIRECT_LAUNCH=0``."""
    global _GRAPH_LAUNCH
    if step.coins is None or step.coins_final is None or direct_disabled() or direct.module() is None:
        return None
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None:
        return None
    _GRAPH_LAUNCH = direct.module().graph_launch
    return raw() or None


_GRAPH_LAUNCH = None  # direct.module().graph_launch, once an entry uses it
# Why graph=True is refused while the current stream captures a graph: an entry's graph would
# become part of the caller's, reading workspace memory the entry's pool may hand to another
# entry once it is dropped (the direct launcher raises the same, from direct.c)
INSIDE_A_CAPTURE = ("eagle_verify(graph=True) was called while the current stream captures a CUDA graph; its entries "
                    "are graphs of their own, which cannot go inside another: inside a capture call eagle_verify "
                    "without graph=True (validate=False), and the step is captured into your graph")


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

    def verify(self, logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator, borrow,
               threshold_single, threshold_acc, impl, validate) -> VerifyResult:
        """:func:`~graphborrow.eagle.eagle_verify` with ``graph=True``: replay the entry of this
        call's key, or run the step eagerly and capture it. Arguments as there.

        Returns:
            The entry's outputs (rewritten by its next replay).

        Raises:
            ValueError: a bad argument, or one the graph path cannot take (the reference
                implementation, a simulated or CPU device, a generator with missing coins).
        """
        call = (logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator, borrow,
                threshold_single, threshold_acc, impl)
        last = self._last
        if last is not None and last.finds(call):
            return last.entry.replay(validate)
        borrowing = borrow is not None and bool(borrow.enabled)
        try:
            key = (_tensor_key(logits), _tensor_key(candidates), _tensor_key(tree.retrive_index),
                   _tensor_key(tree.retrive_next_token), _tensor_key(tree.retrive_next_sibling), tree.tree_depth,
                   _param_key(temperatures), _param_key(top_ks), _param_key(top_ps), _tensor_key(coins),
                   _tensor_key(coins_final), threshold_single, threshold_acc, id(borrow) if borrowing else None)
            entry = self.entries.get(key)
        except (AttributeError, TypeError):  # not tensors, not a tree, not numbers: the capture's checks name it
            key, entry = None, None
        if entry is None:
            out = self._capture(key, logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final,
                                generator, borrow if borrowing else None, threshold_single, threshold_acc, impl,
                                validate)
            entry = self.entries.get(key)
        else:
            self.entries.move_to_end(key)
            out = entry.replay(validate)
        self._last = None if entry is None else _LastCall(call, entry)
        return out

    def _capture(self, key, logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                 borrow, threshold_single, threshold_acc, impl, validate) -> VerifyResult:
        if torch.cuda.is_available() and capturing_now():
            raise ValueError(INSIDE_A_CAPTURE)
        step = VerifyStep.of(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                             threshold_single, threshold_acc)
        if impl not in ("auto", "fused") or resolve_impl(impl, step.logits) != "fused" or not step.logits.is_cuda:
            raise ValueError("graph=True replays the fused kernels from a CUDA graph: it needs CUDA logits, triton "
                             f"and impl='auto' or 'fused' (got impl={impl!r} on {step.logits.device}); call "
                             "without graph=True elsewhere")
        if generator is not None and (coins is None or coins_final is None):
            raise ValueError("graph=True draws missing coins inside the graph from the default CUDA generator; pass "
                             "coins and coins_final, or generator=None")
        step.require_contiguous()
        if validate:
            step.validate()
        out = fused.allocate_outputs(step)
        if step.batch_size == 0:
            return out
        counters = fused.step_counters(step)  # the entry's own: the graph needs no zeroing node
        # the first call's result; kernels compiled before capture
        run_borrowing(borrow, fused.run_step, step, out, True, counters)
        graph = torch.cuda.CUDAGraph()
        if borrow is None:
            with torch.cuda.graph(graph, pool=self._pool(step.logits.get_device())):
                fused.run_step(step, out, True, counters)
        else:
            with borrow.capture_scope(), borrow.backend.graph(graph, pool=borrow.pool_id):
                fused.run_step(step, out, True, counters)
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
        return sum(t.numel() * t.element_size() for e in self.entries.values() for t in (*e.out, e.counters))

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
