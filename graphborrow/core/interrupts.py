"""Critical sections that an asynchronous signal cannot split.

CPython runs a signal's Python handler on the main thread, at the next instruction
boundary it checks: a ``KeyboardInterrupt`` from Ctrl-C, a notebook's interrupt button
or a timer's handler can land between any two steps of a state change (the owner slot
taken but routing not yet on, a free half applied to the simulated allocator's free
lists), and leave the state broken for good.

``with CRITICAL:`` defers every such handler until the section ends. On the main
thread, the outermost section swaps each Python-level handler for a stand-in that only
records the signal; at the end it puts the real handlers back and raises the recorded
signals again (``signal.raise_signal``), so their handlers run right after the section,
where the state is whole. Sections nest and cost almost nothing on other threads, which
never run signal handlers.

Why not ``signal.pthread_sigmask``: it only stops the kernel from delivering to the
thread that blocks. A signal sent to the process (Ctrl-C in a terminal, a notebook's
interrupt, ``setitimer``) then goes to another thread that does not block it (torch's
thread pool, Jupyter's I/O threads), CPython's C handler there flags it, and the main
thread runs the Python handler at its next check, inside the section. Swapping the
Python-level handlers defers a signal whichever thread the kernel chose.

Two places cannot take an exception when the section ends: a finalizer (``__del__``,
``weakref.finalize``), where CPython prints and drops it, and the entry of a scope
(an exception raised from ``__enter__`` after the scope took effect means its
``__exit__`` never runs). There the recorded signals are carried to the next section
end that can raise them (a scope's exit, usually), or posted to the main thread again
by a helper thread after :data:`CARRY_SECONDS`, whichever comes first: they arrive a
moment later, like any asynchronous signal (see :data:`CRITICAL_ENTRY` and
:func:`_inside_finalizer`).

What is not covered: real-time signals (SIGRTMIN and up, which carry no Python
handlers in practice), exceptions raised into a thread by ``PyThreadState_SetAsyncExc``
(not a signal), and the one instruction boundary at the start of a function, before it
can enter a section (see :class:`graphborrow.core.borrow.BorrowScope` for how scopes repair
an exit that an interrupt prevented).
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from _thread import get_ident
from itertools import compress
from typing import Any

try:  # the C functions under the signal module's enum wrappers, which are 20x slower here
    import _signal

    _getsignal, _setsignal = _signal.getsignal, _signal.signal
except ImportError:  # pragma: no cover - other interpreters
    _getsignal, _setsignal = signal.getsignal, signal.signal

__all__ = ["CRITICAL", "CRITICAL_ENTRY", "Critical", "gate_stats", "in_critical_section"]

_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
# the standard signals; real-time ones (SIGRTMIN..SIGRTMAX) carry no Python handlers in
# practice and would double the cost of every section
_FIRST_REALTIME = getattr(signal, "SIGRTMIN", 65)
SIGNALS = tuple(sorted(int(s) for s in signal.valid_signals() if s not in _UNCATCHABLE and s < _FIRST_REALTIME))


class _Gate:
    """The main thread's deferral state (one per process)."""

    __slots__ = (
        "depth", "saved", "pending", "carried", "posting", "originals", "stand_in", "deferred_total", "sections",
        "main",
    )

    def __init__(self) -> None:
        self.depth = 0  # nesting of sections on the main thread
        self.saved: list[tuple[int, Any]] = []  # (signal, real handler) swapped out by close()
        self.originals: dict[int, Any] = {}  # signal -> real handler, while a stand-in is installed
        self.pending: list[int] = []  # signals recorded by a stand-in
        self.carried: list[int] = []  # recorded signals waiting for a place that can raise them
        self.posting = 0  # helper threads that have not finished posting carried signals
        self.stand_in = self._record  # one bound method, so identity checks work
        self.deferred_total = 0  # signals deferred since import (for tests and benchmarks)
        self.sections = 0  # outermost sections entered since import
        self.main = threading.main_thread().ident

    def _record(self, signum: int, frame) -> None:
        if self.depth:
            self.pending.append(signum)
            self.deferred_total += 1
            return
        # a stand-in left installed (its restore was cut short): behave like the real handler
        handler = self.originals.get(signum)
        if callable(handler):
            handler(signum, frame)

    def close(self) -> None:
        """Swap every Python-level handler for the stand-in; raises if a real one fires first."""
        self.saved = []
        stand_in = self.stand_in
        # one pass in C: the signals whose handler is a Python callable (not SIG_DFL / SIG_IGN)
        for signum in list(compress(SIGNALS, map(callable, map(_getsignal, SIGNALS)))):
            handler = _getsignal(signum)
            if handler is stand_in:
                self.saved.append((signum, self.originals[signum]))
                continue
            # recorded first, so an interrupt right after the swap still finds it restorable
            self.originals[signum] = handler
            self.saved.append((signum, handler))
            # signal.signal first runs any pending handler (the real one: it may raise here)
            _setsignal(signum, stand_in)

    def open(self, later: bool = False) -> None:
        """Put the real handlers back, then raise what was recorded (inline, or posted later)."""
        try:
            saved = self.saved
            while saved:
                signum, handler = saved[-1]
                _setsignal(signum, handler)  # pending stand-in calls run first: they record
                saved.pop()
                self.originals.pop(signum, None)
        finally:
            self.depth = 0
            pending, self.pending = self.pending, []
            if pending or self.carried:
                if later or _inside_finalizer():
                    self.carry(pending)
                else:
                    carried = self.carried
                    while carried:  # pop by pop: the helper thread may be taking them too
                        try:
                            pending.append(carried.pop())
                        except IndexError:
                            break
                    _raise_all(list(dict.fromkeys(pending)))

    def carry(self, signals: list[int]) -> None:
        """Keep signals for the next section end that can raise them, or a helper thread.

        The helper posts them to the main thread after :data:`CARRY_SECONDS` if no
        section end took them first, so a carried signal is never held long.
        """
        if not signals:
            return
        self.carried.extend(dict.fromkeys(signals))
        self.posting += 1
        try:
            _thread.start_new_thread(_post_carried, (self,))
        except RuntimeError:  # interpreter shutting down: nobody left to tell
            self.posting -= 1


CARRY_SECONDS = 0.02


def _post_carried(gate: "_Gate") -> None:
    try:
        time.sleep(CARRY_SECONDS)
        carried = gate.carried
        while carried:
            try:
                signum = carried.pop()
            except IndexError:
                break
            signal.pthread_kill(gate.main, signum)
    finally:
        gate.posting -= 1


def _raise_all(signals: list[int], i: int = 0) -> None:
    """Raise each signal again on this thread; every handler runs even if one raises."""
    if i < len(signals):
        try:
            signal.raise_signal(signals[i])
        finally:
            _raise_all(signals, i + 1)


def _inside_finalizer() -> bool:
    """True when an exception raised here would end in a finalizer, which drops it.

    Walks the stack (only when a deferred signal is about to be raised again): a
    ``__del__`` frame, or ``weakref.finalize``'s call, means CPython will print the
    exception and carry on.
    """
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__":
            return True
        if code.co_name == "__call__" and code.co_filename.endswith("weakref.py"):
            return True
        frame = frame.f_back
    return False


_gate = _Gate()


def _after_fork_in_child() -> None:
    _gate.main = threading.main_thread().ident
    _gate.depth = 0
    _gate.pending = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Note [interrupt-safe scopes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A scope that changes state on entry and undoes it on exit (the borrow state's capture,
# replay and borrow scopes; routing allocations to a pool, on either device) is written so
# that an interrupt lands before or after each change, never inside one:
#
#   - __enter__ runs in CRITICAL_ENTRY, which carries a signal past the section: either the
#     scope took effect and __enter__ returns, or nothing changed. An exception raised out of
#     __enter__ after the scope took effect would skip __exit__, so none may be.
#   - __exit__ runs in CRITICAL and does nothing a second time.
#   - One instruction boundary remains: the with statement's, after __enter__ returned and
#     before __exit__ can act. An interrupt there drops the scope without leaving it; its
#     __del__ (in CRITICAL) then leaves it, and for the owner slot, the next claimant
#     reclaims a slot whose scope was collected without leaving.


class Critical:
    """A reentrant critical section (use the shared :data:`CRITICAL` / :data:`CRITICAL_ENTRY`).

    ``later=True`` posts signals recorded during the section from a helper thread
    instead of raising them when it ends: for the entry of a scope, whose ``__enter__``
    must not raise once the scope has taken effect.
    """

    __slots__ = ("later",)

    def __init__(self, later: bool = False) -> None:
        self.later = later

    def __enter__(self) -> None:
        if get_ident() != _gate.main:
            return
        gate = _gate
        if gate.depth:
            gate.depth += 1  # the outer section holds the real handlers: nothing interrupts this
            return
        try:
            gate.depth = 1
            gate.close()
        except BaseException:
            gate.open()  # put back what was swapped; the section never started
            raise
        gate.sections += 1

    def __exit__(self, *exc) -> bool:
        if get_ident() != _gate.main:
            return False
        gate = _gate
        if gate.depth > 1:
            gate.depth -= 1
            return False
        gate.open(self.later)
        return False


CRITICAL = Critical()
CRITICAL_ENTRY = Critical(later=True)


def in_critical_section() -> bool:
    """Whether the calling (main) thread is inside a critical section right now."""
    return get_ident() == _gate.main and _gate.depth > 0


def gate_stats() -> dict[str, int]:
    """Counters since import (outermost sections entered, signals deferred) and now (depth,
    signals recorded or carried and not yet raised, helper threads still posting)."""
    gate = _gate
    return {
        "sections": gate.sections, "deferred": gate.deferred_total, "depth": gate.depth,
        "waiting": len(gate.pending) + len(gate.carried), "posting": gate.posting,
    }
