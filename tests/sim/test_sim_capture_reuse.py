"""``graph_capture_record_stream_reuse``: a block freed after ``record_stream`` inside a capture.

torch's rule (``CUDACachingAllocator.cpp``: ``record_free_markers`` at the free,
``free_safe_blocks_in_capture`` at each allocation): the free records the capture graph's
terminal nodes of every stream that used the block; a later allocation on the block's stream
frees it once each of those nodes precedes that stream's terminals. A stream that never joined
the capture leaves the block deferred until the capture ends, as without the option. Each case
here is a program whose outcome follows from the rule and CUDA's stream-capture semantics,
written down before running it. No GPU has checked the model yet: ``scripts/record_fuzz.py
--kinds reuse`` records the random ``reuse`` programs (:mod:`graphborrow.fidelity.fuzz.reuse`)
on one, for ``data/fuzz``.
"""

import pytest
import torch

from graphborrow.sim import SimBackend
from graphborrow.sim.cuda_api import simulated_cuda

N = 4 * 2**20  # float32 elements: 16 MiB, one segment each
REUSE = "graph_capture_record_stream_reuse:True"


def capture(body, settings: str):
    """Run ``body(side, cur)`` inside a capture on a fresh device; its returned tensors' addresses."""
    backend = SimBackend(backed=False, config=settings, capacity=2**34, activate=False)
    with simulated_cuda(backend):
        side = torch.cuda.Stream()
        out = {}
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out.update(body(side, torch.cuda.current_stream()))
        addresses = {name: t.data_ptr() for name, t in out.items()}
        pending = sum(b["size"] for s in torch.cuda.memory_snapshot() for b in s["blocks"]
                      if b["state"] == "active_pending_free")
    backend.close()
    return addresses, pending


def run(settings: str, join: bool, side_work_after: bool = False, event: bool = False):
    """A block read on the side stream, recorded there and freed; an allocation of its size before the
    capture joins the side stream and one after. Returns the block's address, the two allocations'
    and the bytes still pending when the capture ended."""
    first = {}

    def body(side, cur):
        a = torch.randn(N, device="cuda")
        first["address"] = a.data_ptr()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            b = a * 2
        a.record_stream(side)
        del a
        if side_work_after:
            with torch.cuda.stream(side):
                b.mul_(3)
        before = torch.randn(N, device="cuda")  # nothing orders the side stream's read before this yet
        if join and event:
            e = torch.cuda.Event()
            e.record(side)
            cur.wait_event(e)
        elif join:
            cur.wait_stream(side)
        after = torch.randn(N, device="cuda")
        cur.wait_stream(side)
        return {"before": before, "after": after, "b": b}

    addresses, pending = capture(body, settings)
    return first["address"], addresses, pending


@pytest.mark.parametrize("event", [False, True], ids=["wait_stream", "event"])
def test_a_block_is_reused_once_the_capture_joined_its_last_use(event):
    first, addresses, _ = run(REUSE, join=True, event=event)
    assert addresses["before"] != first  # before the join nothing orders the side stream's read first
    assert addresses["after"] == first


def test_later_work_on_the_using_stream_does_not_hold_it_back():
    first, addresses, _ = run(REUSE, join=True, side_work_after=True)
    assert addresses["after"] == first  # the marker is the read, which precedes the side stream's later work


def test_without_a_join_or_without_the_option_the_free_waits_for_the_capture():
    for settings, join in ((REUSE, False), ("", True)):
        first, addresses, pending = run(settings, join=join)
        assert first not in addresses.values()
        assert pending == N * 4  # still active_pending_free when the capture ended


def test_a_stream_outside_the_capture_defers_the_free_to_its_end():
    def body(side, cur):
        idle = torch.cuda.Stream()  # never joins the capture
        a = torch.randn(N, device="cuda")
        first = a.data_ptr()
        a.record_stream(idle)
        del a
        torch.cuda.current_stream().wait_stream(torch.cuda.current_stream())
        again = torch.randn(N, device="cuda")
        assert again.data_ptr() != first
        return {"again": again}

    capture(body, REUSE)


def test_a_side_streams_block_is_reused_on_the_side_stream_after_it_waits():
    def body(side, cur):
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            u = torch.randn(N, device="cuda")  # a side stream in the capture allocates from its pool
        first = u.data_ptr()
        cur.wait_stream(side)
        v = u + 1
        u.record_stream(cur)
        del u
        with torch.cuda.stream(side):
            early = torch.randn(N, device="cuda")
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            late = torch.randn(N, device="cuda")
        cur.wait_stream(side)
        assert early.data_ptr() != first and late.data_ptr() == first
        return {"v": v, "early": early, "late": late}

    capture(body, REUSE)
