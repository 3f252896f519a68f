"""The cache of native builds (the C arena, the compiled allocator model), built once per content.

A build is named by a tag, a hash of everything it is built from (:func:`content_tag`), so a
build can never be stale: change a source, a compiler flag or the interpreter and the old
build is simply not found. Beside each built file a digest file holds the file's SHA-256.
A file is loaded only when it matches its digest (:func:`problem`): loading a truncated or
overwritten shared library can crash the interpreter (SIGBUS on a page past the end of the
file). Builds happen in temporaries in the cache directory and appear by atomic renames,
the file first and its digest last (:func:`publish`), so concurrent processes either find a
complete, verified build or build their own copy and race harmlessly on the renames. Every
native build goes through :func:`build`, which holds that recipe once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import variables

__all__ = ["build", "cache_dir", "compile_command", "compiler", "content_tag", "digest_path", "is_intact", "prepare",
           "problem", "publish", "temporary_dir"]

CACHE_ENV = "GRAPHBORROW_CACHE_DIR"
TEMPORARY_PREFIX = ".build-"  # every temporary a build leaves while it runs starts with this
_STALE_AFTER_S = 3600.0


def cache_dir() -> Path:
    """Where built libraries live: $GRAPHBORROW_CACHE_DIR, else ~/.cache/graphborrow.

    Per user, not per checkout, so every process of one user shares one verified build.

    Returns:
        The directory (not created here); ``$XDG_CACHE_HOME/graphborrow`` when that is set.
    """
    env = variables.read(CACHE_ENV)
    if env:
        return Path(env)
    base = variables.read("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphborrow"


def compiler(what: str) -> str:
    """The C compiler the native builds run: ``$CC``'s program (its flags are not part of its
    name), else Python's own compiler, else the first of cc, gcc and clang on the PATH.

    Args:
        what: what is being built, for the message (e.g. ``"the bump arena"``).

    Raises:
        RuntimeError: none of them is found.
    """
    name = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(name) is not None:
        return name
    for fallback in ("cc", "gcc", "clang"):
        if shutil.which(fallback):
            return fallback
    raise RuntimeError(f"no C compiler found to build {what}; install gcc (or set CC)")


def build(targets: Sequence[Path], make: Callable[[Path], Sequence[Path]], cache: str,
          force: bool = False) -> list[Path]:
    """The files ``targets`` (in one cache directory) from one build, unless intact builds of
    them all exist.

    ``make(folder)`` builds into ``folder``, a private temporary of the cache directory
    removed afterwards whatever happens, and returns the built files in the order of
    ``targets``; each is then published by atomic renames (:func:`publish`).

    Args:
        targets: where the built files go (``cache_dir() / name``, the name carrying a
            :func:`content_tag` of everything the build depends on).
        make: the build itself; raises RuntimeError naming what failed.
        cache: the cache's name, for the message when it cannot be written
            (e.g. ``"the arena build cache"``).
        force: build even when intact builds exist.

    Returns:
        ``targets``, each a verified build.

    Raises:
        RuntimeError: the cache cannot be written (the message names the setting that moves
            it), or ``make`` failed.
    """
    targets = [Path(t) for t in targets]
    if not force and all(is_intact(t) for t in targets):
        return targets
    directory = targets[0].parent
    prepare(directory, cache)
    with temporary_dir(directory) as folder:
        built = make(folder)
        return [publish(b, t) for b, t in zip(built, targets)]


def compile_command(what: str, command: list[str]) -> None:
    """Run one compiler command; RuntimeError with the command and the compiler's own output when it fails."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        hint = (f"\n(the compiler is CC={os.environ['CC']!r} from the environment: unset CC to use cc, gcc or clang)"
                if os.environ.get("CC") else "")
        raise RuntimeError(f"building {what} failed ({' '.join(command)}):\n{result.stderr}{hint}")


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
