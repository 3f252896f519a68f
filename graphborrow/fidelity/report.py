"""The report of a trace replay: how far the allocator model reproduced a recorded trace."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReplayReport"]


@dataclass
class ReplayReport:
    """How far the simulated allocator reproduced a recorded trace.

    ``agreement`` is matching checks over checks made; None when no check could be made (then
    ``unchecked`` says why): a replay that verified nothing claims no figure. Checks that rest on
    state guessed before a mid-run trace began are not made but counted (``unverifiable``), by
    reason (``unverifiable_reasons``).
    """

    agreement: float | None  # matching checks / checks, in 0..1; None when no check could be made
    mismatches: list[str] = field(default_factory=list)
    events: int = 0  # trace entries read
    checks: int = 0
    unverifiable: int = 0  # checks not made: they depend on state before a mid-run trace began
    unverifiable_reasons: dict[str, int] = field(default_factory=dict)  # why they could not be made, counted
    mid_run: bool = False  # the trace did not start at an empty allocator; its start was rebuilt
    inferred: dict[str, str] = field(default_factory=dict)  # what the trace does not say, as decided
    refuted: int = 0  # pool choices that later entries contradicted (the trace was replayed again)
    stats_checked: int = 0  # memory_stats() entries compared with the recorded ones
    stats_mismatches: list[str] = field(default_factory=list)
    unchecked: str = ""  # why no check could be made (agreement None), in words

    def __str__(self) -> str:
        if self.agreement is None:
            head = f"agreement undefined: {self.unchecked} ({self.events} events"
        else:
            head = (f"agreement {self.agreement:.4f} ({self.checks - len(self.mismatches)}/{self.checks} checks, "
                    f"{self.events} events")
        if self.mid_run:
            head += f", mid-run: {self.unverifiable} checks could not be made"
        if self.inferred:
            head += f", {len(self.inferred)} inferred, {self.refuted} refuted"
        if self.stats_checked:
            head += f", stats {self.stats_checked - len(self.stats_mismatches)}/{self.stats_checked}"
        head += ")"
        lines = [head, *self.mismatches[:20]] + (["..."] if len(self.mismatches) > 20 else [])
        lines += [f"  not made ({count}): {reason}" for reason, count in sorted(self.unverifiable_reasons.items())]
        return "\n".join(lines + self.stats_mismatches[:10])
