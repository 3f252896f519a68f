"""How the benchmarks time things, stated once: medians after warm-up, CUDA events for device time.

Every benchmark reports medians and compares against a baseline measured in the same run
(DESIGN.md, "Measurement rules"); these helpers are the only clocks they use.

    event_us(step, iters=30)      # device time of one call, the GPU idle before it
    host_us(step, iters=30)       # wall time of the Python call itself, the GPU idle before it
    issued_us(step, iters=30)     # wall time per call of calls issued back to back (a serving loop)
    wall_us(fn, iters=2000)       # host-only work (no GPU), e.g. a scope's enter and exit
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["captured", "event_us", "host_us", "issued_us", "pipelined_us", "timed_us", "wall_us"]


def timed_us(body) -> float:
    """CUDA-event microseconds around ``body()``, the GPU idle before it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def event_us(fn, iters: int, warmup: int = 3) -> float:
    """Median CUDA-event time of one call of ``fn``, the GPU idle before each."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed_us(fn) for _ in range(iters))


def pipelined_us(fn, iters: int, rounds: int = 5) -> float:
    """Time per call of ``iters`` calls issued back to back (median over rounds)."""
    fn()

    def calls():
        for _ in range(iters):
            fn()

    return statistics.median(timed_us(calls) / iters for _ in range(rounds))


def host_us(fn, iters: int) -> float:
    """Median wall time of the Python call, the GPU idle before each."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def issued_us(fn, iters: int, rounds: int = 5) -> float:
    """Host wall time per call of ``iters`` calls issued back to back, nothing waiting for the
    GPU between them (median over rounds): what a loop that launches a step after the
    previous one pays on the host. The GPU queue (about a thousand launches) never fills here."""
    fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
    torch.cuda.synchronize()
    return statistics.median(samples)


def wall_us(fn, iters: int = 2000, warmup: int = 200) -> float:
    """Median wall time of host-only work (nothing waits for the GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def captured(fn):
    """``fn`` warmed up on a side stream, then captured by hand into a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
