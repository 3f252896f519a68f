"""The compiled allocator model against the pure-Python one, and how the build is found.

Each check runs in a fresh interpreter: a process holds one ``graphborrow.sim.allocator``,
and which one it is gets decided when ``graphborrow.sim`` is first imported.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graphborrow.sim import compiled

REPO = Path(__file__).resolve().parents[1]

# Drives a compiled and a pure-Python allocator with the same random operations and
# compares snapshots and stats after every one, then the full trace history.
LOCKSTEP = textwrap.dedent(
    """
    import importlib.util, random, sys
    import torch
    from graphborrow.sim import compiled
    from graphborrow.sim.memory import PhysicalMemory
    from graphborrow.sim.streams import Clockwork
    import graphborrow.sim.allocator as fast

    assert compiled.implementation() == "compiled", compiled.implementation()
    spec = importlib.util.spec_from_file_location("graphborrow.sim.allocator_reference", compiled.SOURCES[0])
    pure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pure)
    MiB = 2**20

    class BumpPool:  # a pluggable pool's raw allocator: a bump pointer over its own range
        def __init__(self, base):
            self.next = base
        def raw_alloc(self, nbytes, stream):
            ptr, self.next = self.next, self.next + nbytes
            return ptr
        def raw_delete(self, ptr, nbytes, stream):
            pass

    def make(module, config, fraction):
        a = module.CachingAllocator(PhysicalMemory(capacity=768 * MiB, backed=False), Clockwork(), config)
        a.set_memory_fraction(fraction)
        a.record_history(True)
        return a

    def step(a, rng, live, routes):
        op = rng.random()
        if op < 0.45 or not live:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 40 * MiB)])
            try:
                live.append(a.malloc(size, rng.choice((0, 0, 1)), thread=7))
            except torch.OutOfMemoryError as exc:
                return "oom: " + str(exc)
        elif op < 0.80:
            block = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.25:
                a.record_stream(block, 2)
            a.free(block)
        elif op < 0.86:
            a.clockwork.stream(2).enqueue(rng.choice((5.0, 50.0)))
        elif op < 0.90:
            a.clockwork.advance(rng.choice((1.0, 20.0)))
        elif op < 0.93:
            a.clockwork.synchronize()
        elif op < 0.96:
            if routes:
                pool_id = routes.pop()
                a.end_allocate_to_pool(pool_id)
                a.release_pool(pool_id)
            else:
                kind = rng.choice(("graph", "mempool", "pluggable"))
                pool_id = a.new_pool_id("graph" if kind == "graph" else "handle")
                if kind == "pluggable":
                    a.create_or_incref_pool(pool_id, BumpPool(0x100000000000 + pool_id[1] * 2**32),
                                            use_on_oom=True, no_split=rng.random() < 0.5)
                    a.begin_allocate_to_pool(pool_id, lambda stream, thread: thread == 7)
                    a.release_pool(pool_id)  # begin took its own reference
                else:
                    a.begin_allocate_to_pool(pool_id, lambda stream, thread: stream == 1)
                routes.append(pool_id)
        elif not routes:
            a.empty_cache()
        return None

    def run(config, fraction, seed, steps):
        rng_f, rng_p = random.Random(seed), random.Random(seed)
        f, p = make(fast, config, fraction), make(pure, config, fraction)
        live_f, live_p, routes_f, routes_p = [], [], [], []
        for i in range(steps):
            out_f, out_p = step(f, rng_f, live_f, routes_f), step(p, rng_p, live_p, routes_p)
            where = f"config {config!r}, seed {seed}, step {i}"
            assert out_f == out_p, (where, out_f, out_p)
            assert f.snapshot() == p.snapshot(), where
            assert f.memory_stats() == p.memory_stats(), where
        assert f.full_snapshot() == p.full_snapshot(), (config, seed)
        return len(f.full_snapshot()["device_traces"][0])

    events = 0
    for config, fraction in ((None, 1.0), ("max_split_size_mb:40", 1.0), ("roundup_power2_divisions:4", 1.0),
                             ("max_split_size_mb:64,roundup_power2_divisions:[256:4,>:1]", 1.0),
                             ("expandable_segments:True", 1.0), ("garbage_collection_threshold:0.5", 0.7),
                             ("expandable_segments:True,max_split_size_mb:30,garbage_collection_threshold:0.6", 0.8)):
        for seed in range(2):
            events += run(config, fraction, seed, 1500)
    print("trace events compared:", events)
    """
)


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def built():
    """The compiled build of these sources (built here if `python -m graphborrow build` was not run)."""
    return compiled.build()


def test_compiled_and_pure_python_agree_operation_by_operation(built):
    result = python(LOCKSTEP, **{compiled.PURE_ENV: ""})
    assert result.returncode == 0, result.stderr[-4000:]
    events = int(result.stdout.split("trace events compared:")[1])
    assert events > 10_000  # both models really ran: mallocs, frees, segments, OOMs, events


def test_the_pure_python_model_replays_every_h200_trace():
    code = textwrap.dedent(
        """
        from pathlib import Path
        from graphborrow.sim import compiled, replay_trace
        assert compiled.implementation() == "pure Python"
        for path in sorted(Path("data/traces").glob("*.pickle")):
            report = replay_trace(path)
            assert report.agreement == 1.0, (path, report.mismatches[:3])
            print(path.name, report.checks)
        """
    )
    result = python(code, **{compiled.PURE_ENV: "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(result.stdout.splitlines()) == 3


def test_the_environment_variable_selects_pure_python(built):
    code = "import graphborrow.sim.allocator as a; from graphborrow.sim import compiled; print(compiled.implementation(), a.__file__)"
    pure = python(code, **{compiled.PURE_ENV: "1"})
    assert pure.returncode == 0, pure.stderr
    assert pure.stdout.startswith("pure Python") and pure.stdout.strip().endswith("allocator.py")
    fast = python(code, **{compiled.PURE_ENV: ""})
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout.startswith("compiled") and str(built) in fast.stdout


def test_a_build_that_does_not_load_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path))
    compiled.build_path().write_bytes(b"not a shared library")
    code = "from graphborrow.sim import compiled, SimBackend; import torch; print(compiled.implementation())"
    result = python(code, GRAPHBORROW_CACHE_DIR=str(tmp_path), **{compiled.PURE_ENV: ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pure Python"
    assert "did not load" in result.stderr and "python -m graphborrow build --force" in result.stderr


def test_a_build_is_named_by_its_sources(tmp_path):
    copies = []
    for source in compiled.SOURCES:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    assert compiled.build_tag(tuple(copies)) == compiled.build_tag()
    copies[1].write_text(copies[1].read_text() + "\n# an edit\n")
    assert compiled.build_tag(tuple(copies)) != compiled.build_tag()
