"""What a run of a given size can hold, and a pool where the arena's fit policy decides.

The caching allocator's size classes make capacity a step function of the run's size, not a
byte count: a step's small tensors carve a 2 MiB small-pool segment out of a run; a 1-10 MiB
tensor needs a whole 20 MiB segment; larger ones a 2 MiB multiple. :func:`largest_borrowable`
and :func:`size_class_table` teach those classes by asking the planner
(:mod:`graphborrow.planning.planner`); :func:`unborrowable_runs` names runs that can never
hold a borrow. :func:`fit_policy_pool` captures a pool where best fit and first fit differ.
Whether a verification step fits is :func:`graphborrow.eagle.plan.plan_verify`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from graphborrow.core.borrow import BorrowState
from graphborrow.core.sizes import MB, size_class
from graphborrow.device import get_backend

from .planner import AllocationSequence, PoolImage, replay

__all__ = ["FitPolicyPool", "fit_policy_pool", "largest_borrowable", "size_class_table", "unborrowable_runs"]


# ----------------------------------------------------------------------------- size classes


def largest_borrowable(run_bytes: int, seeds: Sequence[int] = ()) -> int:
    """The largest single tensor a fresh borrow pool over one run of ``run_bytes`` can hold.

    Found by the planner, class by class (the answer is not monotone in the tensor size:
    a 1-10 MiB tensor needs a 20 MiB segment where a 10 MiB one needs 10):

    - runs under 2 MiB hold nothing (not even a small-pool segment);
    - runs of 2 MiB to 10 MiB hold small tensors only (up to 1 MiB);
    - runs of 10 MiB to 20 MiB add large tensors up to the run rounded down to 2 MiB,
      but no 1-10 MiB tensor;
    - from 20 MiB every class, up to the run rounded down to 2 MiB.

    Args:
        run_bytes: the run's size.
        seeds: the pool's precarve over that run (``state.precarve_sizes([(0, run_bytes)])``):
            a precarved segment holds any large tensor up to its size.

    Returns:
        Bytes (0: the run can never hold a borrow).

    Raises:
        ValueError: ``run_bytes`` is not an int >= 0.
    """
    if isinstance(run_bytes, bool) or not isinstance(run_bytes, int) or run_bytes < 0:
        raise ValueError(f"run_bytes must be an int >= 0, got {run_bytes!r}")
    image = PoolImage.from_runs([(1 << 40, run_bytes)], seeds=seeds) if run_bytes else PoolImage()
    best = 0
    for low, high in ((1, 1 * MB), (1 * MB + 1, 10 * MB - 1), (10 * MB, max(run_bytes, 10 * MB))):
        if _fits_one(image, low):
            while low < high:  # largest size in [low, high] that fits (monotone within a class)
                mid = (low + high + 1) // 2
                low, high = (mid, high) if _fits_one(image, mid) else (low, mid - 1)
            best = max(best, low)
    return best


def _fits_one(image: PoolImage, nbytes: int) -> bool:
    return replay(AllocationSequence((("alloc", -1, nbytes, 0),)), image).fits


def size_class_table(run_sizes: Iterable[int] | None = None) -> list[dict]:
    """Rows for the figure "largest borrowable tensor against run size"
    (:func:`graphborrow.studies.plots.largest_borrowable_plot`).

    Args:
        run_sizes: run sizes in bytes (default: every 256 KiB up to 40 MiB).

    Returns:
        One dict per run: ``run_bytes``, ``largest_bytes`` and ``class`` (the size class of
        the largest borrowable tensor, or "none").
    """
    if run_sizes is None:
        run_sizes = range(MB // 4, 40 * MB + 1, MB // 4)
    rows = []
    for run in run_sizes:
        largest = largest_borrowable(int(run))
        rows.append({"run_bytes": int(run), "largest_bytes": largest,
                     "class": size_class(largest).name if largest else "none"})
    return rows


def unborrowable_runs(runs: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """The ``(address, nbytes)`` runs that can never hold a borrow: too small for even a 2 MiB
    small-pool segment (the arena carves whole segments).

    Args:
        runs: ``(address, nbytes)`` pairs, as :func:`graphborrow.core.runs.find_free_runs` returns them.

    Returns:
        The runs whose :func:`largest_borrowable` is 0, in the order given.
    """
    return [(int(a), int(n)) for a, n in runs if largest_borrowable(int(n)) == 0]


# ----------------------------------------------------------------------------- fit policy


class FitPolicyPool:
    """A captured graph pool whose free runs make the arena's fit policy decide what fits.

    Two graphs leave a 20 MiB run (a whole segment whose 9 MiB intermediates died) and a
    12 MiB one (behind an 8 MiB output kept alive), plus small-pool slivers under 2 MiB
    that can never hold a borrow. A step whose small tensors come first and that then
    needs one 20 MiB segment (any 1-10 MiB tensor) fits under best fit, which carves the
    2 MiB small-pool segment out of the 12 MiB run, and not under first fit, which carves
    it out of the 20 MiB run (the first extent: runs come largest first). Precarve is off,
    so the arena alone decides.

    Args:
        backend: the device (any :class:`~graphborrow.core.device_api.DeviceAPI`; active if
            simulated); None for the one ``torch.cuda`` is (:func:`graphborrow.use_device`).
    """

    def __init__(self, backend=None) -> None:
        backend = backend if backend is not None else get_backend("auto")
        self.backend = backend
        self.state = BorrowState(backend, pool_id=backend.graph_pool_handle(), precarve=False)
        self.pool_id = self.state.pool_id
        b = backend
        self.inputs = [torch.empty(8 * MB // 4, device=b.device), torch.empty(9 * MB // 4, device=b.device)]
        b.synchronize()
        self.graphs, self.outputs = [b.CUDAGraph(), b.CUDAGraph()], []
        with self.state.capture_scope(), b.graph(self.graphs[0], pool=self.pool_id):
            self.outputs.append(self.inputs[0] * 2)  # kept: 12 MiB stay free behind it
        with self.state.capture_scope(), b.graph(self.graphs[1], pool=self.pool_id):
            doubled = self.inputs[1] * 2  # takes the 12 MiB block
            shifted = self.inputs[1] + 1  # needs a segment of its own: 20 MiB
            self.outputs.append(doubled[:8] + shifted[:8])
            del doubled, shifted
        b.synchronize()

    def snapshot(self) -> list[dict]:
        """The pool's segments, to show its runs.

        Returns:
            Segment dicts in torch's snapshot format, this pool's only.
        """
        return self.backend.memory_snapshot(self.pool_id)


def fit_policy_pool(backend=None) -> FitPolicyPool:
    """A pool where best fit and first fit change what fits (see :class:`FitPolicyPool`).

    Args:
        backend: the device (any :class:`~graphborrow.core.device_api.DeviceAPI`; active if
            simulated); None for the one ``torch.cuda`` is.

    Returns:
        The :class:`FitPolicyPool`, its ``state`` ready to borrow.
    """
    return FitPolicyPool(backend)
