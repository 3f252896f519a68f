"""Critical sections defer signal handlers, whichever thread the kernel delivers to."""

import os
import signal
import threading
import time

import pytest

from graphborrow.core.interrupts import (
    CRITICAL,
    CRITICAL_ENTRY,
    gate_stats,
    in_critical_section,
)


class Interrupted(Exception):
    pass


@pytest.fixture
def alarm():
    """SIGALRM raises Interrupted; restored afterwards."""
    def handler(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    yield handler
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def spin(seconds):
    """Python work with plenty of points where CPython runs pending handlers."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += sum(range(10))
    return n


def test_a_timer_signal_inside_a_section_is_raised_when_it_ends(alarm):
    finished = []
    with pytest.raises(Interrupted):
        with CRITICAL:
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            spin(0.1)
            finished.append(True)  # the section ran to its end
    assert finished == [True]
    assert signal.getsignal(signal.SIGALRM) is alarm  # the real handler is back


def test_a_process_signal_taken_by_another_thread_is_deferred_too(alarm):
    """Blocking the signal on the main thread would not be enough: another thread takes it."""
    ready, sent = threading.Event(), threading.Event()

    def sender():
        ready.wait()
        os.kill(os.getpid(), signal.SIGALRM)  # to the process: any thread may take it
        sent.set()

    t = threading.Thread(target=sender)
    t.start()
    finished = []
    with pytest.raises(Interrupted):
        with CRITICAL:
            ready.set()
            sent.wait(5)
            spin(0.05)
            finished.append(True)
    t.join()
    assert finished == [True]


def test_nested_sections_deliver_at_the_outermost_end(alarm):
    log = []
    with pytest.raises(Interrupted):
        with CRITICAL:
            with CRITICAL:
                signal.setitimer(signal.ITIMER_REAL, 0.005)
                spin(0.05)
            log.append("inner done")
            assert in_critical_section()
            spin(0.01)
            log.append("outer done")
    assert log == ["inner done", "outer done"] and not in_critical_section()


def test_a_signal_before_the_section_is_not_deferred(alarm):
    signal.setitimer(signal.ITIMER_REAL, 0.001)
    with pytest.raises(Interrupted):
        spin(0.05)
    with CRITICAL:
        spin(0.01)  # nothing pending: nothing raised
    assert gate_stats()["depth"] == 0


def test_sections_on_other_threads_do_nothing():
    seen = []

    def worker():
        with CRITICAL:
            seen.append(in_critical_section())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [False]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ignored_and_default_dispositions_are_left_alone():
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with CRITICAL:
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_every_deferred_signal_is_raised_even_if_one_handler_raises(alarm):
    got = []

    def usr1(signum, frame):
        got.append(signum)

    previous = signal.signal(signal.SIGUSR1, usr1)
    try:
        with pytest.raises(Interrupted):
            with CRITICAL:
                os.kill(os.getpid(), signal.SIGALRM)
                os.kill(os.getpid(), signal.SIGUSR1)
                spin(0.01)
                assert got == []
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _wait_for_interrupt(seconds=5.0):
    try:
        spin(seconds)
    except Interrupted:
        return True
    return False


def test_a_signal_deferred_inside_a_finalizer_arrives_after_it_instead_of_being_dropped(alarm, capsys):
    class Dies:
        def __del__(self):
            with CRITICAL:
                os.kill(os.getpid(), signal.SIGALRM)
                spin(0.01)

    obj = Dies()
    del obj  # CPython would print and drop an exception raised in __del__
    assert _wait_for_interrupt()
    assert "Exception ignored" not in capsys.readouterr().err


def test_the_entry_section_posts_its_signals_instead_of_raising(alarm):
    entered = []
    with CRITICAL_ENTRY:
        os.kill(os.getpid(), signal.SIGALRM)
        spin(0.01)
    entered.append(True)  # nothing raised at the section's end
    assert _wait_for_interrupt()
    assert entered == [True]


def test_a_stand_in_left_installed_behaves_like_the_real_handler(alarm):
    from graphborrow.core import interrupts

    gate = interrupts._gate
    with CRITICAL:
        stand_in = signal.getsignal(signal.SIGALRM)
        assert stand_in is not alarm
    signal.signal(signal.SIGALRM, stand_in)  # as if a restore had been cut short
    gate.originals[signal.SIGALRM] = alarm
    with pytest.raises(Interrupted):  # outside a section it forwards to the real handler
        os.kill(os.getpid(), signal.SIGALRM)
        spin(0.05)
    with pytest.raises(Interrupted):
        with CRITICAL:  # and inside one it still defers, and is replaced by the real one after
            os.kill(os.getpid(), signal.SIGALRM)
            spin(0.01)
    assert signal.getsignal(signal.SIGALRM) is alarm
