"""The cache of native builds: the C arena, the compiled allocator model and the fused kernels'
launchers, built once per content.

A build is named by a tag, a hash of everything it is built from (:func:`content_tag`), so a
build can never be stale: change a source, a compiler flag or the interpreter and the old
build is simply not found. Beside each built file a digest file holds the file's SHA-256.
A file is loaded only when it matches its digest (:func:`problem`): loading a truncated or
overwritten shared library can crash the interpreter (SIGBUS on a page past the end of the
file). Builds happen in temporaries in the cache directory and appear by atomic renames,
the file first and its digest last (:func:`publish`), so concurrent processes either find a
complete, verified build or build their own copy and race harmlessly on the renames.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["build_extension", "cache_dir", "compiler", "content_tag", "cxx_compiler", "digest_path", "is_intact",
           "load_extension", "prepare", "problem", "publish", "temporary_dir"]

CACHE_ENV = "GRAPHBORROW_CACHE_DIR"
TEMPORARY_PREFIX = ".build-"  # every temporary a build leaves while it runs starts with this
_STALE_AFTER_S = 3600.0


def cache_dir() -> Path:
    """Where built libraries live: $GRAPHBORROW_CACHE_DIR, else ~/.cache/graphborrow.

    Per user, not per checkout, so every process of one user shares one verified build.

    Returns:
        The directory (not created here); ``$XDG_CACHE_HOME/graphborrow`` when that is set.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphborrow"


def compiler(what: str) -> str:
    """The C compiler the native builds run: ``$CC``'s program (its flags are not part of its
    name), else Python's own compiler, else the first of cc, gcc and clang on the PATH.

    Args:
        what: what is being built, for the message (e.g. ``"the bump arena"``).

    Raises:
        RuntimeError: none of them is found.
    """
    return _program(os.environ.get("CC") or sysconfig.get_config_var("CC"), ("cc", "gcc", "clang"),
                    f"no C compiler found to build {what}; install gcc (or set CC)")


def cxx_compiler(what: str) -> str:
    """The C++ compiler: ``$CXX``'s program, else Python's own, else the first of c++, g++ and
    clang++ on the PATH (as :func:`compiler` finds the C one).

    Raises:
        RuntimeError: none of them is found.
    """
    return _program(os.environ.get("CXX") or sysconfig.get_config_var("CXX"), ("c++", "g++", "clang++"),
                    f"no C++ compiler found to build {what}; install g++ (or set CXX)")


def _program(setting: str | None, fallbacks: tuple, missing: str) -> str:
    """The program ``setting`` names (flags after it are not part of its name), else the first
    of ``fallbacks`` on the PATH; RuntimeError(``missing``) when none is found."""
    name = (setting or fallbacks[0]).split()[0]
    if shutil.which(name) is not None:
        return name
    for fallback in fallbacks:
        if shutil.which(fallback):
            return fallback
    raise RuntimeError(missing)


def build_extension(what: str, name: str, source: Path, find_compiler: Callable[[str], str],
                    command: Callable[[str, Path, str], list], *tag_parts: bytes) -> Path:
    """A Python extension module compiled from one source file into the cache, unless an intact
    build of it exists (the fused kernels' direct launcher and compiled eager path).

    Args:
        what: what is being built, for the messages (e.g. ``"the direct launcher"``).
        name: the module's name (its ``PyInit_`` name); the file is ``<name>-<tag><EXT_SUFFIX>``.
        source: the source file.
        find_compiler: :func:`compiler` or :func:`cxx_compiler`.
        command: ``command(compiler, output, python_include)``, the compile command.
        tag_parts: what else the build depends on (beside the source, the interpreter, the
            machine and Python's headers).

    Returns:
        The built file's path.

    Raises:
        RuntimeError: no compiler, no Python headers, or the compile failed (its message).
    """
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    tag = content_tag(source.read_bytes(), f"{sys.implementation.cache_tag}{suffix}".encode(),
                      platform.machine().encode(), include.encode(), *tag_parts)
    target = cache_dir() / f"{name}-{tag}{suffix}"
    if is_intact(target):
        return target
    program = find_compiler(what)
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"building {what} needs Python's headers (no Python.h in {include}); install the "
                           "python3-dev package of this interpreter")
    prepare(target.parent, f"{what}'s build cache")
    with temporary_dir(target.parent) as tmp:
        built = tmp / target.name
        compile_command = command(program, built, include)
        result = subprocess.run(compile_command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {what} failed ({' '.join(compile_command)}):\n{result.stderr}")
        return publish(built, target)


def load_extension(name: str, path: Path):
    """The extension module ``name`` loaded from ``path`` (a file :func:`build_extension` made)."""
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def content_tag(*parts: bytes) -> str:
    """A 16-hex-digit name for a build made from ``parts`` (sources, flags, platform, versions)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())  # hashed apart, so parts cannot run into each other
    return digest.hexdigest()[:16]


def digest_path(artifact: Path) -> Path:
    """The file beside a built file that holds its SHA-256: ``<artifact>.sha256`` (it may not exist)."""
    return artifact.with_name(artifact.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def problem(artifact: Path) -> str | None:
    """Why the built file ``artifact`` must not be loaded, or None when it is intact.

    Returns:
        ``"it is not built"``, ``"<name> has no checksum file (an interrupted build)"``,
        ``"it cannot be read (...)"``, ``"<name> does not match its checksum (a truncated or
        damaged file)"``, or None.
    """
    if not artifact.exists():
        return "it is not built"
    checksum = digest_path(artifact)
    if not checksum.exists():
        return f"{artifact.name} has no checksum file (an interrupted build)"
    try:
        expected = checksum.read_text().strip()
        actual = _sha256(artifact)
    except OSError as error:
        return f"it cannot be read ({error})"
    if actual != expected:
        return f"{artifact.name} does not match its checksum (a truncated or damaged file)"
    return None


def is_intact(artifact: Path) -> bool:
    """True when ``artifact`` exists and matches the digest recorded when it was built."""
    return problem(artifact) is None


def prepare(directory: Path, what: str) -> None:
    """Make ``directory`` ready for builds: created, writable, old temporaries of dead builds removed.

    Args:
        directory: the cache directory (:func:`cache_dir`).
        what: what is being built, for the message (e.g. ``"the arena build cache"``).

    Raises:
        RuntimeError: the directory cannot be created or written; the message names the setting
            that moves it.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=TEMPORARY_PREFIX, delete=True)
        probe.close()
    except OSError as exc:
        raise RuntimeError(
            f"cannot write {what} {directory} ({exc}); set {CACHE_ENV} to a writable folder"
        ) from None
    remove_stale_temporaries(directory)


def remove_stale_temporaries(directory: Path, max_age_s: float = _STALE_AFTER_S) -> None:
    """Delete build temporaries left by builds that died (a kill -9, a full disk); young ones may be running."""
    now = time.time()
    for leftover in directory.glob(TEMPORARY_PREFIX + "*"):
        try:
            if now - leftover.stat().st_mtime <= max_age_s:
                continue
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink()
        except OSError:
            pass


@contextmanager
def temporary_dir(directory: Path) -> Iterator[Path]:
    """A private folder for one build inside the cache directory (so renames out of it are atomic), removed after."""
    path = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX, dir=directory))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def publish(built: Path, target: Path) -> Path:
    """Move the finished file ``built`` (in the same file system) to ``target``, then its digest beside it.

    Both appear by atomic renames, the file first: a reader who finds the digest finds the
    file it describes, and one who finds no digest (an interrupted publish) rebuilds.

    Returns:
        ``target``.
    """
    checksum = built.with_name(built.name + ".sha256")
    checksum.write_text(_sha256(built) + "\n")
    try:
        os.replace(built, target)
        os.replace(checksum, digest_path(target))
    finally:
        for leftover in (built, checksum):
            if leftover.exists():
                leftover.unlink()
    return target
