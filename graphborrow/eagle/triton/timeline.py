"""Where a fused step's device time goes: the persistent kernel's own clock, read back.

CUDA events time a step from outside; inside it, hundreds of programs take tickets from
one queue and wait on each other's rows, so which phase holds the step up is not visible
from there. A *traced* configuration compiles ``verify_kernel`` with ``TRACE`` on: every ticket
writes when it was taken, when its wait ended, when its work was done and when its
program moved on (after publishing, or after walking a tree), with the SM, the program,
the item's stage and row; every program writes when it started and left. The clock is the
GPU's ``%globaltimer`` (nanoseconds, one clock for every SM), so the records of different
programs line up.

    config = traced_config(step)             # a configuration of its own, never the cached one
    out = run_traced(config, step)           # or capture it in a graph and replay it
    timeline = StepTimeline.of(config.trace.cpu().numpy(), config)
    timeline.milestones                      # ns from the first program's start

Only the one-launch step is traced (every plain step, and top-k / top-p below
``SPLIT_ROWS`` rows). The records cost the kernel a few stores per ticket; compare the
traced step's event time with the untraced one's before reading the times as the step's.
"""

from __future__ import annotations

import numpy as np
import torch

from ..step import VerifyResult, VerifyStep
from . import fused
from .launch_config import SPLIT_ROWS, StepConfig, step_config
from .step_kernel import TRACE_FIELDS

__all__ = ["StepTimeline", "run_traced", "traced_config"]

# the record's fields, as _trace_ticket writes them (a program's record: started, left, SM)
TAKEN, WAITED, DONE, MOVED_ON, SM, PROGRAM, STAGE, FLAGS = range(TRACE_FIELDS)
RESIDUAL_STAGE = -2


def traced_config(step: VerifyStep) -> StepConfig:
    """A fresh configuration of ``step``'s shape whose launch records its clock times in ``config.trace``.

    Raises:
        ValueError: the step runs as several launches (top-k / top-p from ``SPLIT_ROWS``
            rows), which the trace does not cover.
    """
    cached = step_config(step)
    config = StepConfig(cached.bs, cached.d, cached.vocab, cached.steps, cached.forms, cached.in_place, cached.device)
    if len(config.groups) != 1:
        raise ValueError(f"a traced step must run as one launch; top-k / top-p at {config.rows} rows runs as "
                         f"{len(config.groups)} (trace below {SPLIT_ROWS} rows, or the plain step)")
    end = config.groups[0][1]  # (a grid never has more programs than items)
    config.trace = torch.zeros((2 * end, TRACE_FIELDS), dtype=torch.int64, device=step.logits.device)
    return config


def run_traced(config: StepConfig, step: VerifyStep, out: VerifyResult | None = None) -> VerifyResult:
    """One launch of ``config`` (from :func:`traced_config`) on ``step``, in a fresh workspace,
    so it can be captured in a CUDA graph; returns the outputs (when ``out`` is None, new ones
    in the cached configuration's layout, which a traced one shares)."""
    if out is None:
        out = fused.allocate_outputs(step)
    fused.run_config(config, step, out)
    return out


class StepTimeline:
    """One traced launch, decoded: ``milestones`` (ns after the first program started, in
    the order the step reaches them) and ``items`` (median ns of each kind of item's parts).

    Milestones: ``programs started`` (the last program's start), ``maxima done``, ``sums
    done`` (every row's statistics in), ``walks started`` / ``walks done`` (the first walk's
    start, the last walk's end), ``residual seen`` (the first residual item past its wait),
    ``masses done`` (the last residual item that did not sample), ``sampled`` (the last
    request's token written) and ``programs left``.

    Items (median ns): ``ticket`` (a program's previous ticket moved on, to this one taken),
    ``max`` (a maximum's work), ``sum wait`` / ``sum`` (a sum's wait for its row's maxima,
    its work), ``publish`` (a row's last arrival publishing it), ``walk``, ``residual wait``
    / ``residual`` (a residual's wait for its tree's walk, its work), ``sample`` (the
    sampling item's work, its own residual mass included).
    """

    def __init__(self, milestones: dict, items: dict, programs: int):
        self.milestones, self.items, self.programs = milestones, items, programs

    @classmethod
    def of(cls, trace: np.ndarray, config: StepConfig) -> "StepTimeline":
        """Decode ``trace`` ([tickets + programs, TRACE_FIELDS] int64, as the launch left it)."""
        end = config.groups[0][1]
        programs = config.programs[0]
        tickets, progs = trace[:end], trace[end:end + programs]
        if (tickets[:, TAKEN] == 0).any() or (progs[:, 1] == 0).any():
            raise ValueError("the trace is incomplete: a ticket or program wrote no record (was it launched "
                             "with this configuration's grid?)")
        zero = progs[:, 0].min()
        t = lambda rows, field: rows[:, field] - zero  # noqa: E731 (ns after the first start)
        stage, flags = tickets[:, STAGE], tickets[:, FLAGS]
        finishing, acted = (flags & 1) == 1, (flags & 2) == 2
        maxima, sums = tickets[stage == 0], tickets[stage == 1]
        residual = stage == RESIDUAL_STAGE
        walks = tickets[acted & ~residual]
        samples, masses = tickets[acted & residual], tickets[residual & ~acted]
        milestones = {
            "programs started": int(t(progs, 0).max()),
            "maxima done": int(t(maxima, MOVED_ON).max()),
            "sums done": int(t(sums, DONE).max()),
            "walks started": int(t(walks, DONE).min()) if len(walks) else None,
            "walks done": int(t(walks, MOVED_ON).max()) if len(walks) else None,
            "residual seen": int(t(tickets[residual], WAITED).min()) if residual.any() else None,
            "masses done": int(t(masses, DONE).max()) if len(masses) else None,
            "sampled": int(t(samples, DONE).max()) if len(samples) else None,
            "programs left": int(t(progs, 1).max()),
        }
        order = np.lexsort((tickets[:, TAKEN], tickets[:, PROGRAM]))
        ordered = tickets[order]
        same = ordered[1:, PROGRAM] == ordered[:-1, PROGRAM]
        gaps = (ordered[1:, TAKEN] - ordered[:-1, MOVED_ON])[same]
        publishing = tickets[finishing & ~acted & ~residual]
        items = {
            "ticket": _median(gaps),
            "max": _median(maxima[:, DONE] - maxima[:, WAITED]),
            "sum wait": _median(sums[:, WAITED] - sums[:, TAKEN]),
            "sum": _median(sums[:, DONE] - sums[:, WAITED]),
            "publish": _median(publishing[:, MOVED_ON] - publishing[:, DONE]),
            "walk": _median(walks[:, MOVED_ON] - walks[:, DONE]),
            "residual wait": _median(masses[:, WAITED] - masses[:, TAKEN]),
            "residual": _median(masses[:, DONE] - masses[:, WAITED]),
            "sample": _median(samples[:, DONE] - samples[:, WAITED]),
        }
        return cls(milestones, items, programs)


def _median(values: np.ndarray):
    return float(np.median(values)) if len(values) else None
