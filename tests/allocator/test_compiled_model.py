"""The compiled allocator model against the pure-Python one, and how the build is found.

Each check runs in a fresh interpreter: a process holds one build of the allocator modules
(``stats``, ``blocks``, ``caching``), and which one it is gets decided when
``graphborrow.allocator`` is first imported.
"""

import ast
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graphborrow.allocator import compiled
from graphborrow.core import native

REPO = Path(__file__).resolve().parents[2]

# Drives a compiled and a pure-Python allocator with the same random operations and
# compares snapshots and stats after every one, then the full trace history.
LOCKSTEP = textwrap.dedent(
    """
    import random
    import torch
    from graphborrow.allocator import compiled
    from graphborrow.allocator.memory import PhysicalMemory
    from graphborrow.allocator.streams import Clockwork
    import graphborrow.allocator.caching as fast

    assert compiled.implementation() == "compiled", compiled.implementation()
    pure = compiled.pure_model()
    assert pure.__file__.endswith("caching.py") and pure.Block.__module__.endswith("pure_source.blocks")
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
        from graphborrow.allocator import compiled
        from graphborrow.fidelity.replay import replay_trace
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
    code = "import graphborrow.allocator.caching as a; from graphborrow.allocator import compiled; print(compiled.implementation(), a.__file__)"
    pure = python(code, **{compiled.PURE_ENV: "1"})
    assert pure.returncode == 0, pure.stderr
    assert pure.stdout.startswith("pure Python") and pure.stdout.strip().endswith("caching.py")
    fast = python(code, **{compiled.PURE_ENV: ""})
    assert fast.returncode == 0, fast.stderr
    assert fast.stdout.startswith("compiled") and str(built["caching"]) in fast.stdout


def _copy_build(built: dict[str, Path], cache: Path) -> dict[str, Path]:
    """The intact build (every module and its checksum), copied into another cache directory."""
    targets = {}
    for module, path in built.items():
        targets[module] = cache / path.name
        shutil.copy(path, targets[module])
        shutil.copy(path.with_name(path.name + ".sha256"), cache / (path.name + ".sha256"))
    return targets


IMPORT = "from graphborrow.allocator import compiled; from graphborrow.sim import SimBackend; import torch; print(compiled.implementation())"


def test_a_truncated_build_is_never_loaded(built, tmp_path):
    target = _copy_build(built, tmp_path)["caching"]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])  # a build cut off mid-copy
    result = python(IMPORT, GRAPHBORROW_CACHE_DIR=str(tmp_path), **{compiled.PURE_ENV: ""})
    assert result.returncode == 0, result.stderr  # no crash: the damaged library was not loaded
    assert result.stdout.strip() == "pure Python"
    assert "does not match its checksum" in result.stderr and "python -m graphborrow build --force" in result.stderr


def test_a_library_without_its_checksum_is_not_loaded(tmp_path):
    for path in compiled.build_paths().values():
        (tmp_path / path.name).write_bytes(b"not a shared library")
    result = python(IMPORT, GRAPHBORROW_CACHE_DIR=str(tmp_path), **{compiled.PURE_ENV: ""})
    assert result.returncode == 0 and result.stdout.strip() == "pure Python"
    assert "no checksum file" in result.stderr


def test_running_without_a_build_is_announced_unless_chosen(tmp_path):
    result = python(IMPORT, GRAPHBORROW_CACHE_DIR=str(tmp_path), **{compiled.PURE_ENV: ""})
    assert result.stdout.strip() == "pure Python" and "it is not built" in result.stderr
    chosen = python(IMPORT, GRAPHBORROW_CACHE_DIR=str(tmp_path), **{compiled.PURE_ENV: "1"})
    assert chosen.stdout.strip() == "pure Python" and "pure-Python model" not in chosen.stderr


@pytest.mark.slow
@pytest.mark.deep  # rebuilds the Cython model from scratch, as make setup does; the damaged, truncated and
# checksum-less builds that make test checks load prebuilt files instead
def test_build_force_replaces_a_damaged_build(built, tmp_path):
    targets = _copy_build(built, tmp_path)
    target = targets["blocks"]
    target.write_bytes(b"\x7fELF" + b"\0" * 100)  # damaged, with the old checksum beside it
    rebuilt = subprocess.run([sys.executable, "-m", "graphborrow", "build", "--force"], cwd=REPO, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "GRAPHBORROW_CACHE_DIR": str(tmp_path)})
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert native.problem(target) is None
    after = python(IMPORT, GRAPHBORROW_CACHE_DIR=str(tmp_path), **{compiled.PURE_ENV: ""})
    assert after.stdout.strip() == "compiled", after.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        name for path in targets.values() for name in (path.name, path.name + ".sha256"))


def test_a_failed_build_says_why_and_leaves_nothing_behind(tmp_path):
    env = {**os.environ, "GRAPHBORROW_CACHE_DIR": str(tmp_path), "CC": "/nonexistent/cc", compiled.PURE_ENV: "1"}
    failed = subprocess.run([sys.executable, "-m", "graphborrow", "build", "--force"], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=env)
    assert failed.returncode == 1
    assert "compiling the allocator model failed" in failed.stderr and "C compiler" in failed.stderr
    assert list(tmp_path.iterdir()) == []  # no partial library, no 0-byte temporaries


def test_a_cython_failure_is_not_blamed_on_the_compiler(tmp_path, monkeypatch):
    """Cython 3.3.0 once crashed on this source; the message must send the reader to Cython, not to gcc."""
    broken = tmp_path / "src"
    broken.mkdir()
    for source in compiled.SOURCES:
        shutil.copy(source, broken / source.name)
    (broken / "caching.py").write_text("def malloc(:\n    pass\n")  # no Cython translates this
    monkeypatch.setattr(compiled, "SOURCES", tuple(broken / source.name for source in compiled.SOURCES))
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"Cython .* could not translate .* not a missing compiler") as failed:
        compiled.build(force=True)
    assert "gcc" not in str(failed.value)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-built is left to be loaded


def test_an_unwritable_cache_is_named(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")  # as unwritable as a read-only folder
    env = {**os.environ, "GRAPHBORROW_CACHE_DIR": str(blocked / "cache"), compiled.PURE_ENV: "1"}
    failed = subprocess.run([sys.executable, "-m", "graphborrow", "build"], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=env)
    assert failed.returncode == 1 and "GRAPHBORROW_CACHE_DIR" in failed.stderr and "writable" in failed.stderr


def test_a_build_is_named_by_its_sources_cython_and_directives(tmp_path, monkeypatch):
    copies = []
    for source in compiled.SOURCES:
        copy = tmp_path / source.name
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    tag = compiled.build_tag(tuple(copies))
    assert tag == compiled.build_tag()
    copies[1].write_text(copies[1].read_text() + "\n# an edit\n")
    assert compiled.build_tag(tuple(copies)) != tag
    monkeypatch.setattr(compiled, "_cython_version", lambda: "0.29.0")
    assert compiled.build_tag() != tag
    monkeypatch.undo()
    monkeypatch.setitem(compiled.CYTHON_DIRECTIVES, "boundscheck", False)
    assert compiled.build_tag() != tag


# ----------------------------------------------------------------------------- the .pxd and the .py agree


def _pxd_declarations(text: str) -> tuple[dict, dict]:
    """From a .pxd: class -> (fields, {method: parameters}) and function -> parameters."""
    classes, functions, current = {}, {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("cdef class "):
            current = re.match(r"cdef class (\w+)", stripped).group(1)
            classes[current] = (set(), {})
        elif not line.startswith((" ", "\t")) and stripped and not stripped.startswith(("@", "#", "cimport", "from ")):
            current = None
            match = re.match(r"cpdef \w+ (\w+)\((.*)\)", stripped)
            if match:
                functions[match.group(1)] = _parameters(match.group(2))
        elif current and stripped.startswith("cdef public "):  # cdef public <type> a, b, c
            parts = stripped[len("cdef public "):].split(",")
            classes[current][0].update(part.split()[-1] for part in parts)
        elif current and stripped.startswith("cpdef "):
            match = re.match(r"cpdef (?:[\w\" ]+ )?(\w+)\((.*)\)", stripped)
            classes[current][1][match.group(1)] = _parameters(match.group(2))
    return classes, functions


def _module_sources() -> dict[str, tuple[Path, Path]]:
    """Compiled module -> (its .py, its .pxd)."""
    return {module: (compiled.HERE / f"{module}.py", compiled.HERE / f"{module}.pxd") for module in compiled.MODULES}


def _parameters(text: str) -> list[str]:
    names = []
    for part in text.split(","):
        part = part.strip().split("=")[0].strip()
        if part:
            names.append(part.split()[-1])
    return names


def test_the_pxd_declares_exactly_what_the_py_defines():
    """A field or argument added to one file and not the other fails here, not at run time."""
    seen = set()
    for module, (py, pxd) in _module_sources().items():
        source = importlib.import_module(f"graphborrow.allocator.{module}")
        if not str(source.__file__).endswith(".py"):  # this process runs the build: read the source itself
            spec = importlib.util.spec_from_file_location(f"graphborrow.allocator._{module}_source", py)
            source = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(source)
        classes, functions = _pxd_declarations(pxd.read_text())
        seen |= set(classes)
        for name, (fields, methods) in classes.items():
            cls = getattr(source, name)
            if "__slots__" in cls.__dict__:
                assert fields == set(cls.__slots__), f"{name}: .pxd fields {sorted(fields)} != __slots__ {sorted(cls.__slots__)}"
            else:  # the allocator keeps no __slots__: every declared field is set in __init__
                init = inspect.getsource(cls.__init__)
                missing = [f for f in fields if not re.search(rf"self\.{f}\s*[:=]", init)]
                assert missing == [], f"{name}: declared in the .pxd, never set in __init__: {missing}"
            for method, parameters in methods.items():
                defined = list(inspect.signature(getattr(cls, method)).parameters)
                assert defined == parameters, f"{name}.{method}: .pxd {parameters} != .py {defined}"
        for function, parameters in functions.items():
            assert list(inspect.signature(getattr(source, function)).parameters) == parameters, function
    assert {"Stat", "StatArray", "DeviceStats", "Segment", "Block", "FreeList", "BlockPool", "CachingAllocator"} <= seen


def fields_out_of_step(source: str, pxd: str) -> dict[str, tuple[list, list]]:
    """Class -> (set on ``self`` in its methods but not declared, declared but never set on ``self``).

    Only classes the .pxd declares and that keep no ``__slots__`` are compared (a class with
    ``__slots__`` refuses an undeclared attribute in pure Python too, and its slots are checked
    against the .pxd above); an attribute set on ``self`` anywhere in a method of such a class
    (``self.x = ...``, ``self.x += ...``, ``self.x: T = ...``) counts. A compiled extension
    type has no ``__dict__``: an undeclared one raises AttributeError at run time, in the
    compiled build only.
    """
    declared = {name: fields for name, (fields, _) in _pxd_declarations(pxd)[0].items()}
    result = {}
    for cls in ast.parse(source).body:
        slots = any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in node.targets)
                    for node in getattr(cls, "body", ()))
        if isinstance(cls, ast.ClassDef) and cls.name in declared and not slots:
            assigned = {
                node.attr for node in ast.walk(cls)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(node.value, ast.Name) and node.value.id == "self"
            }
            undeclared, unset = sorted(assigned - declared[cls.name]), sorted(declared[cls.name] - assigned)
            if undeclared or unset:
                result[cls.name] = (undeclared, unset)
    return result


def test_every_attribute_set_on_self_is_declared_in_the_pxd_and_back():
    for module, (py, pxd) in _module_sources().items():
        assert fields_out_of_step(py.read_text(), pxd.read_text()) == {}, module


def test_the_field_check_finds_an_undeclared_attribute_and_an_unused_declaration():
    sources = _module_sources()
    source, pxd = (path.read_text() for path in sources["caching"])
    anchor = "    def segments(self) -> list[Segment]:\n"
    assert anchor in source
    extra = source.replace(anchor, "    def audit(self) -> None:\n        self.audit_extra = 0\n\n" + anchor)
    assert fields_out_of_step(extra, pxd) == {"CachingAllocator": (["audit_extra"], [])}
    stale = pxd.replace("cdef public bint expandable, gc_enabled, _fast", "cdef public bint expandable, gc_enabled, _fast, retired")
    assert stale != pxd
    assert fields_out_of_step(source, stale) == {"CachingAllocator": ([], ["retired"])}
