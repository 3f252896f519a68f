"""The native-build cache shared by the native builds (the C arena, the compiled allocator, the fused
kernels' launchers): names, digests, publishing, compilers.

The builds themselves are tested where they are made (tests/core/test_arena.py builds the
arena in fresh processes, damaged and concurrent; tests/allocator/test_compiled_model.py the
compiled allocator); here are the rules both rest on.
"""

import hashlib
import os
import threading

import pytest

from graphborrow.core import native


def test_cache_dir_prefers_its_own_setting_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "own"
    monkeypatch.delenv("GRAPHBORROW_CACHE_DIR")
    assert native.cache_dir() == tmp_path / "xdg" / "graphborrow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.cache_dir() == tmp_path / "home" / ".cache" / "graphborrow"


def test_a_tag_changes_with_every_part_and_with_where_parts_divide():
    tag = native.content_tag(b"source", b"linux", b"x86_64")
    assert len(tag) == 16 and int(tag, 16) >= 0
    assert native.content_tag(b"source", b"linux", b"x86_64") == tag
    assert native.content_tag(b"source!", b"linux", b"x86_64") != tag
    assert native.content_tag(b"source", b"linux", b"aarch64") != tag
    assert native.content_tag(b"sourcel", b"inux", b"x86_64") != tag  # the same bytes, divided elsewhere


def test_a_file_is_intact_only_with_a_matching_digest(tmp_path):
    library = tmp_path / "libx.so"
    assert native.problem(library) == "it is not built" and not native.is_intact(library)
    library.write_bytes(b"\x7fELF library bytes")
    assert native.problem(library) == "libx.so has no checksum file (an interrupted build)"
    native.digest_path(library).write_text(hashlib.sha256(b"\x7fELF library bytes").hexdigest() + "\n")
    assert native.digest_path(library) == tmp_path / "libx.so.sha256"
    assert native.problem(library) is None and native.is_intact(library)
    library.write_bytes(b"\x7fELF library byte")
    assert native.problem(library) == "libx.so does not match its checksum (a truncated or damaged file)"


def test_publish_moves_the_file_then_its_digest_and_leaves_no_temporaries(tmp_path):
    native.prepare(tmp_path, "the test cache")
    target = tmp_path / "libx.so"
    with native.temporary_dir(tmp_path) as build:
        built = build / "out.so"
        built.write_bytes(b"built bytes")
        assert native.publish(built, target) == target
        assert not built.exists() and list(build.iterdir()) == []
    assert native.is_intact(target) and target.read_bytes() == b"built bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libx.so", "libx.so.sha256"]


def test_concurrent_publishers_leave_one_intact_file(tmp_path):
    target = tmp_path / "libx.so"
    errors = []

    def publish(n: int) -> None:
        try:
            with native.temporary_dir(tmp_path) as build:
                built = build / "out.so"
                built.write_bytes(b"same build" * 1000)
                native.publish(built, target)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and native.is_intact(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libx.so", "libx.so.sha256"]


def test_only_old_build_temporaries_are_removed(tmp_path):
    old, young, other = tmp_path / ".build-a.so", tmp_path / ".build-b.so", tmp_path / "keep.so"
    for path in (old, young, other):
        path.write_bytes(b"")
    old_dir = tmp_path / ".build-dead"
    old_dir.mkdir()
    (old_dir / "half.so").write_bytes(b"")
    for path in (old, other, old_dir):
        os.utime(path, (0, 0))
    native.remove_stale_temporaries(tmp_path, max_age_s=3600.0)
    assert not old.exists() and not old_dir.exists() and young.exists() and other.exists()
    native.remove_stale_temporaries(tmp_path, max_age_s=-1.0)
    assert not young.exists() and other.exists()


def test_an_unwritable_cache_names_the_setting_that_moves_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match=r"cannot write the test cache .*set GRAPHBORROW_CACHE_DIR to a writable"):
        native.prepare(blocker / "cache", "the test cache")


def test_a_build_makes_its_targets_once_and_a_failed_one_leaves_nothing(tmp_path):
    """native.build: the first call makes every target in a private temporary and publishes
    them (file and digest each); later calls find them intact and make nothing, unless
    forced; a make that raises leaves neither targets nor temporaries; a damaged target is
    made again."""
    targets = [tmp_path / "cache" / "a-0123.so", tmp_path / "cache" / "b-0123.so"]
    made = []

    def make(folder):
        assert folder.parent == targets[0].parent and folder.name.startswith(native.TEMPORARY_PREFIX)
        made.append(folder)
        for target, text in zip(targets, ("first", "second")):
            (folder / target.name).write_text(text)
        return [folder / t.name for t in targets]

    assert native.build(targets, make, "the test cache") == targets and len(made) == 1
    assert [t.read_text() for t in targets] == ["first", "second"] and all(native.is_intact(t) for t in targets)
    assert native.build(targets, make, "the test cache") == targets and len(made) == 1  # intact: not made
    native.build(targets, make, "the test cache", force=True)
    assert len(made) == 2
    targets[1].write_text("damaged")
    native.build(targets, make, "the test cache")
    assert len(made) == 3 and targets[1].read_text() == "second"
    assert sorted(p.name for p in targets[0].parent.iterdir()) == sorted(
        [t.name for t in targets] + [native.digest_path(t).name for t in targets])

    def broken(folder):
        (folder / "half-written.so").write_text("x")
        raise RuntimeError("building the test failed")

    other = [tmp_path / "other" / "c-0123.so"]
    with pytest.raises(RuntimeError, match="building the test failed"):
        native.build(other, broken, "the test cache")
    assert list(other[0].parent.iterdir()) == []


def test_a_failing_compile_command_names_the_command_and_the_compilers_output():
    with pytest.raises(RuntimeError, match=r"building the test failed \(sh -c echo oops >&2; exit 3\):\noops"):
        native.compile_command("the test", ["sh", "-c", "echo oops >&2; exit 3"])


def test_a_failing_compiler_from_cc_says_how_to_use_the_usual_one(tmp_path, monkeypatch):
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\necho broken compiler >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with pytest.raises(RuntimeError, match=r"(?s)broken compiler.*CC=.*badcc.* unset CC to use cc, gcc or clang"):
        native.compile_command("the test library", [str(bad), "-c", "x.c"])
    monkeypatch.delenv("CC")
    with pytest.raises(RuntimeError) as failed:
        native.compile_command("the test library", [str(bad), "-c", "x.c"])
    assert "unset CC" not in str(failed.value)
