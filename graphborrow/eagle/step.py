"""One verification step as a record: its inputs checked once, its result, and which implementation runs it.

:class:`VerifyStep` holds what every implementation of the step reads (the reference
modes of :mod:`.modes`, the fused kernel of :mod:`graphborrow.eagle.triton.fused`): logits,
the draft tree, per-request sampling parameters, coins and thresholds.
:meth:`VerifyStep.check` reads shapes only; :meth:`VerifyStep.validate` reads values (see
:mod:`.validate`). Every implementation returns a :class:`VerifyResult`, and
:func:`choose_impl` is the one rule for which of them runs, asked by ``eagle_verify`` and
by the capacity planner alike.

:func:`prepare` turns the record into :class:`DeviceParams`, the reference step's first
temporaries: per-request parameters as [bs] tensors, coins and the tree tables. They are
always fresh tensors of the same sizes, whatever form the caller gave (a number or a
tensor, coins given or drawn), so a step's allocations depend on its shape alone.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any, NamedTuple, Optional

import torch

from graphborrow.sim.tensor import is_sim_tensor

from .draft_tree import DraftTree
from .tree_sampling import TreeTables
from .validate import (
    LOGIT_DTYPES,
    check_candidates,
    check_logits_rows,
    check_thresholds,
    check_tree,
    expect,
)

TREE_TABLES = ("tree.retrive_index", "tree.retrive_next_token", "tree.retrive_next_sibling")

__all__ = ["IMPLS", "DeviceParams", "StepShape", "VerifyResult", "VerifyStep", "check_outputs", "choose_impl", "draw",
           "draw_into", "fused_available", "prepare", "real_cuda"]

IMPLS = ("auto", "reference", "fused")


class VerifyResult(NamedTuple):
    """``predicts`` [bs*D] int32: the emitted token at each accepted node's slot;
    ``accept_index`` [bs, S] int32: accepted nodes' slots (-1 past the path);
    ``accept_length`` [bs] int32: tokens emitted per request (accepted drafts + 1)."""

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor


def choose_impl(impl: str, real_cuda: bool) -> str:
    """The implementation ``eagle_verify(impl=impl)`` runs: ``"reference"`` or ``"fused"``.

    ``"auto"`` takes the fused kernels on a real CUDA device where Triton is installed, and
    the reference elsewhere (CPU, the simulated device); ``"reference"`` and ``"fused"`` are
    what they say (whether the fused kernels can launch there is the caller's check).

    Args:
        impl: ``"auto"``, ``"reference"`` or ``"fused"``.
        real_cuda: whether the step's tensors are on a real CUDA device (for a borrow state:
            whether its backend is one).

    Returns:
        ``"reference"`` or ``"fused"``.

    Raises:
        ValueError: an unknown ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "fused" if real_cuda and fused_available() else "reference"
    return impl


def real_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a real CUDA device: what :func:`choose_impl` asks of a step's logits.

    Args:
        tensor: any tensor.

    Returns:
        True on a CUDA device, False on the CPU and on the simulated device (whose tensors
        report ``is_cuda`` to code written for a GPU).
    """
    return tensor.is_cuda and (type(tensor) is torch.Tensor or not is_sim_tensor(tensor))


@functools.cache
def fused_available() -> bool:
    """Whether the fused kernels can be imported: triton is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None


class StepShape(NamedTuple):
    """What a step's allocation sequence depends on (and nothing else)."""

    batch_size: int
    draft_tokens: int
    vocab: int
    top_k: bool
    top_p: bool
    logits_dtype: torch.dtype = torch.float32


@dataclasses.dataclass
class VerifyStep:
    """One non-greedy EAGLE verification step of ``tree`` against ``logits`` [bs*D, V].

    ``temperatures`` (> 0), ``top_ks`` (>= 1) and ``top_ps`` (in (0, 1]) are numbers or
    per-request tensors [bs]; ``top_ks`` / ``top_ps`` None skip that renorm. ``coins``
    [bs, D] / ``coins_final`` [bs] fix the randomness; missing ones are drawn (from
    ``generator`` when given). Thresholds as in the upstream kernel (1.0: exact).
    """

    logits: torch.Tensor
    candidates: torch.Tensor
    tree: DraftTree
    temperatures: Any
    top_ks: Any = None
    top_ps: Any = None
    coins: Optional[torch.Tensor] = None
    coins_final: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None
    threshold_single: float = 1.0
    threshold_acc: float = 1.0

    @property
    def batch_size(self) -> int:
        return self.candidates.shape[0]

    @property
    def draft_tokens(self) -> int:
        return self.candidates.shape[1]

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]

    @property
    def tree_depth(self) -> int:
        return int(self.tree.tree_depth)

    @property
    def shape(self) -> StepShape:
        return StepShape(self.batch_size, self.draft_tokens, self.vocab, self.top_ks is not None,
                         self.top_ps is not None, self.logits.dtype)

    @classmethod
    def of(cls, logits, candidates, tree, temperatures, top_ks=None, top_ps=None, coins=None, coins_final=None,
           generator=None, threshold_single=1.0, threshold_acc=1.0) -> "VerifyStep":
        """The checked step of a call's arguments (``candidates`` None: the tree's); see :meth:`check`."""
        if candidates is None:
            candidates = getattr(tree, "candidates", None)
        return cls(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                   threshold_single, threshold_acc).check()

    def check(self) -> "VerifyStep":
        """Shapes, dtypes and plain numbers (reads no tensor values). Returns self."""
        if not isinstance(self.tree, DraftTree) and not hasattr(self.tree, "retrive_next_token"):
            raise ValueError("tree must be a DraftTree (see build_draft_tree / tree_from_parents)")
        c = self.candidates
        if not isinstance(c, torch.Tensor) or c.dim() != 2 or c.dtype != torch.int64:
            raise ValueError("candidates must be an int64 tensor [bs, D] (draft tokens, node 0 = root)")
        bs, d = c.shape
        if d < 1:
            raise ValueError("candidates must hold at least the root (D >= 1)")
        table = getattr(self.tree, "retrive_index", None)
        if isinstance(table, torch.Tensor) and tuple(table.shape) != (bs, d):
            raise ValueError(f"candidates are [{bs}, {d}] but the tree's tables are {list(table.shape)}: pass "
                             "candidates=None for the tree's own, or candidates of the tree's [bs, D]")
        logits = self.logits
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != bs * d:
            raise ValueError(
                f"logits must be [bs*D, V] = [{bs * d}, V] (one row per tree node), got "
                f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
            )
        if logits.dtype not in LOGIT_DTYPES:
            raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
        if not logits.is_contiguous():
            raise ValueError("logits must be contiguous; call .contiguous() first")
        if logits.shape[1] < 1:
            raise ValueError("logits have an empty vocabulary dimension")
        tree = self.tree
        for t, name in zip((tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling), TREE_TABLES):
            expect(t, name, c.shape, torch.int64)
        for t, name in ((c, "candidates"), (tree.retrive_index, "the tree"), (self.coins, "coins"),
                        (self.coins_final, "coins_final")):
            if isinstance(t, torch.Tensor) and t.device != logits.device:
                raise ValueError(f"{name} on {t.device} and the logits on {logits.device}: the step's tensors live on "
                                 "one device; move them there with .to(logits.device)")
        depth = self.tree.tree_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"tree.tree_depth must be an int >= 1 (the accept width S), got {depth!r}")
        if self.coins is not None:
            expect(self.coins, "coins", (bs, d), torch.float32)
        if self.coins_final is not None:
            expect(self.coins_final, "coins_final", (bs,), torch.float32)
        self.threshold_single, self.threshold_acc = check_thresholds(self.threshold_single, self.threshold_acc)
        _check_per_request(self.temperatures, bs, "temperatures", False)
        if self.top_ks is not None:
            _check_per_request(self.top_ks, bs, "top_ks", True)
        if self.top_ps is not None:
            _check_per_request(self.top_ps, bs, "top_ps", False)
        return self

    def require_contiguous(self) -> None:
        """The fused kernels read the candidates, tree and coins as raw memory (the reference
        takes any layout): each must be contiguous."""
        tree = self.tree
        for t, name in ((self.candidates, "candidates"), (tree.retrive_index, "tree.retrive_index"),
                        (tree.retrive_next_token, "tree.retrive_next_token"),
                        (tree.retrive_next_sibling, "tree.retrive_next_sibling"), (self.coins, "coins"),
                        (self.coins_final, "coins_final")):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous for the fused kernels; call .contiguous() first")

    def validate(self) -> None:
        """The value checks (they read on the host): tree, candidates, parameters, logits rows."""
        bs, d = self.candidates.shape
        check_tree(self.tree.retrive_next_token, self.tree.retrive_next_sibling, self.tree.retrive_index, bs * d)
        check_candidates(self.candidates, self.vocab)
        temps = _as_rows(self.temperatures, bs, torch.float32)
        if bool((~(temps > 0) | ~torch.isfinite(temps)).any()):
            raise ValueError("temperatures must be finite and > 0 (greedy requests take the argmax path instead)")
        if self.top_ks is not None and bool((_as_rows(self.top_ks, bs, torch.long) < 1).any()):
            raise ValueError(f"top_k must be >= 1 (a value >= the vocabulary {self.vocab} keeps all)")
        if self.top_ps is not None:
            top_p = _as_rows(self.top_ps, bs, torch.float32)
            if bool((~(top_p > 0) | (top_p > 1)).any()):
                raise ValueError("top_p must be in (0, 1] (1 keeps all)")
        for name in ("coins", "coins_final"):
            coins = getattr(self, name)
            if coins is not None and coins.numel() and not bool(((coins >= 0) & (coins < 1)).all()):
                raise ValueError(f"{name} must be uniform samples in [0, 1)")
        check_logits_rows(self.logits, temps, d)

    def rows(self, lo: int, hi: int) -> "VerifyStep":
        """The step of requests lo..hi-1 (views; parameters sliced where per request)."""
        d = self.draft_tokens
        tree = self.tree._replace(**{name: getattr(self.tree, name)[lo:hi]
                                     for name in ("candidates", "retrive_index", "retrive_next_token",
                                                  "retrive_next_sibling")})
        return dataclasses.replace(
            self, logits=self.logits[lo * d:hi * d], candidates=self.candidates[lo:hi], tree=tree,
            temperatures=_slice(self.temperatures, lo, hi), top_ks=_slice(self.top_ks, lo, hi),
            top_ps=_slice(self.top_ps, lo, hi), coins=_slice(self.coins, lo, hi),
            coins_final=_slice(self.coins_final, lo, hi),
        )


class DeviceParams(NamedTuple):
    """The step's parameters on the device, one row per request, and its tree tables."""

    temps: torch.Tensor             # [bs] float32
    top_k: Optional[torch.Tensor]   # [bs] int64, or None: no top-k renorm
    top_p: Optional[torch.Tensor]   # [bs] float32, or None: no top-p renorm
    coins: torch.Tensor             # [bs, D] float32
    coins_final: torch.Tensor       # [bs] float32
    tables: TreeTables

    def rows(self, lo: int, hi: int) -> "DeviceParams":
        """Requests lo..hi-1 (views)."""
        return DeviceParams(self.temps[lo:hi], _slice(self.top_k, lo, hi), _slice(self.top_p, lo, hi),
                            self.coins[lo:hi], self.coins_final[lo:hi], self.tables.rows(lo, hi))


def prepare(step: VerifyStep) -> DeviceParams:
    """Allocate the step's parameters, coins and tree tables next to its logits."""
    bs, d = step.candidates.shape
    like = step.logits
    return DeviceParams(
        temps=_per_request(step.temperatures, bs, like, torch.float32),
        top_k=None if step.top_ks is None else _per_request(step.top_ks, bs, like, torch.long),
        top_p=None if step.top_ps is None else _per_request(step.top_ps, bs, like, torch.float32),
        coins=draw(step.coins, (bs, d), step.generator, like),
        coins_final=draw(step.coins_final, (bs,), step.generator, like),
        tables=TreeTables.build(step.candidates, step.tree.retrive_next_token, step.tree.retrive_next_sibling),
    )


def draw(given, shape, generator, like) -> torch.Tensor:
    """A fresh [shape] float32 tensor next to ``like``: the caller's coins, or uniforms in [0, 1)."""
    out = like.new_empty(shape, dtype=torch.float32)
    if given is not None:
        return out.copy_(given)
    return draw_into(out, generator)


def draw_into(out: torch.Tensor, generator) -> torch.Tensor:
    """Fill float32 ``out`` with uniforms in [0, 1), from ``generator`` when given (a CPU
    generator draws on the host, as ``torch.rand`` would, then copies). Returns ``out``."""
    if generator is None:
        return out.uniform_()
    if generator.device.type == "cpu":
        return out.copy_(torch.rand(out.shape, generator=generator))
    return out.uniform_(generator=generator)


def check_outputs(out, step: VerifyStep) -> tuple:
    """Caller-given output buffers: ``(predicts [bs*D], accept_index [bs, S], accept_length
    [bs])``, int32 and contiguous (the kernels write them whole). Returns them as a tuple."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError("out must be (predicts [bs*D] int32, accept_index [bs, S] int32, accept_length [bs] int32)")
    bs, d = step.batch_size, step.draft_tokens
    for t, name, shape in zip(out, ("predicts", "accept_index", "accept_length"),
                              ((bs * d,), (bs, step.tree_depth), (bs,))):
        expect(t, f"out {name}", shape, torch.int32)
        if t.device != step.logits.device:
            raise ValueError(f"out {name} must be on the logits' device ({step.logits.device}), got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"out {name} must be contiguous; call .contiguous() first")
    # the kernels read the inputs while they write the outputs: a shared byte would be silently wrong
    outputs = [(f"out {n}", _span(t)) for n, t in zip(("predicts", "accept_index", "accept_length"), out)]
    inputs = [(n, _span(t)) for n, t in (("logits", step.logits), ("candidates", step.candidates),
                                          ("coins", step.coins), ("coins_final", step.coins_final),
                                          ("temperatures", step.temperatures), ("top_ks", step.top_ks),
                                          ("top_ps", step.top_ps), ("retrive_index", step.tree[1]),
                                          ("retrive_next_token", step.tree[2]),
                                          ("retrive_next_sibling", step.tree[3]))
              if isinstance(t, torch.Tensor)]
    for i, (name, (device, lo, hi)) in enumerate(outputs):
        for other, (other_device, other_lo, other_hi) in outputs[:i] + inputs:
            if device == other_device and lo < other_hi and other_lo < hi:
                raise ValueError(f"{name} shares memory with {other}: the step would overwrite what it reads; "
                                 "give out= buffers of their own (torch.empty_like, or call without out=)")
    return tuple(out)


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(device index, first byte, end)`` of the bytes ``t`` spans; an empty tensor spans none."""
    start = t.data_ptr()
    if t.is_contiguous():
        return t.get_device(), start, start + t.numel() * t.element_size()
    if t.numel() == 0:
        return t.get_device(), start, start
    last = sum((n - 1) * abs(k) for n, k in zip(t.shape, t.stride()))
    return t.get_device(), start, start + (last + 1) * t.element_size()


def _per_request(value, bs, like, dtype) -> torch.Tensor:
    """A number or a per-request tensor as a fresh [bs] tensor next to ``like``."""
    if isinstance(value, torch.Tensor):
        return like.new_empty(bs, dtype=dtype).copy_(value.reshape(-1).expand(bs))
    return like.new_full((bs,), value, dtype=dtype)


def _check_per_request(value, bs, name, integer) -> None:
    if value is None and name != "temperatures":
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != bs and not (value.dim() == 0 or value.numel() == 1 and bs == 0):
            raise ValueError(
                f"{name} must be a number or hold one value per request ({bs}), got shape {tuple(value.shape)}"
            )
        if integer and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got {value.dtype}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor of one value per request, got {type(value).__name__}")
    if integer and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value}")


def _as_rows(value, bs, dtype) -> torch.Tensor:
    """A per-request parameter as a host tensor [bs], for value checks."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(-1).expand(bs).to(dtype)
    return torch.full((bs,), value, dtype=dtype, device="cpu")


def _slice(value, lo, hi):
    return value[lo:hi] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
