"""The allocator model compiled by Cython: the same source, a few times faster.

``caching.py`` is the model and stays plain Python; ``caching.pxd`` beside it gives
Cython C types for the hot classes and locals. ``python -m graphborrow build`` builds an
extension module from the two into the cache directory, named by a hash of both files, the
interpreter, the Cython version and the compiler directives, so a build can never be stale:
change any of them and the old build is simply not found. Beside each build a checksum file
is written last; a build whose bytes do not match it (a truncated or damaged file) is never
loaded, because loading a damaged shared library can crash the interpreter.

When ``graphborrow.sim`` is imported, :func:`install` loads a matching, intact build and
otherwise runs the pure-Python module, saying so once (set ``GRAPHBORROW_SIM_PURE=1`` to
choose pure Python on purpose, silently). Both run the same rules;
``tests/allocator/test_sim_compiled.py`` checks them against each other operation by operation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

from graphborrow.core.arena import cache_dir

__all__ = ["PURE_ENV", "SOURCES", "build", "build_path", "build_tag", "implementation", "install", "verify"]

MODULE = "graphborrow.allocator.caching"
HERE = Path(__file__).parent
SOURCES = (HERE / "caching.py", HERE / "caching.pxd")
PURE_ENV = "GRAPHBORROW_SIM_PURE"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
CYTHON_DIRECTIVES = {"language_level": 3, "annotation_typing": False}
_CHECKSUM = ".sha256"


def _cython_version() -> str:
    try:
        return metadata.version("Cython")
    except metadata.PackageNotFoundError:
        return "none"


def build_tag(sources: tuple[Path, ...] = SOURCES) -> str:
    """Hash of what a build depends on: the sources, the interpreter, Cython and its directives."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    digest.update(f"{sys.implementation.cache_tag}{EXT_SUFFIX}{platform.machine()}".encode())
    digest.update(f"cython {_cython_version()} {sorted(CYTHON_DIRECTIVES.items())}".encode())
    return digest.hexdigest()[:16]


def build_path() -> Path:
    return cache_dir() / f"sim-allocator-{build_tag()}{EXT_SUFFIX}"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(path: Path) -> str | None:
    """Why the build at ``path`` must not be loaded (missing, no checksum, damaged), or None when intact."""
    checksum = path.with_name(path.name + _CHECKSUM)
    if not path.exists():
        return "it is not built"
    if not checksum.exists():
        return f"{path.name} has no checksum file (an interrupted build)"
    try:
        expected = checksum.read_text().strip()
        actual = _digest(path)
    except OSError as error:
        return f"it cannot be read ({error})"
    if actual != expected:
        return f"{path.name} does not match its checksum (a truncated or damaged file)"
    return None


def build(force: bool = False, quiet: bool = True) -> Path:
    """Compile the allocator model unless an intact build of these sources exists; return its path.

    Needs Cython, setuptools, a C compiler and a writable cache directory; raises
    RuntimeError naming what is missing. The library and then its checksum appear by atomic
    renames, so concurrent builds race harmlessly and an interrupted one leaves nothing that
    would be loaded; temporary files are removed whatever happens.
    """
    target = build_path()
    if not force and verify(target) is None:
        return target
    try:
        from Cython.Build import cythonize
        from setuptools import Distribution, Extension
    except ImportError as exc:
        raise RuntimeError(
            f"building the compiled allocator needs Cython and setuptools ({exc}); "
            "install them with: pip install 'cython>=3' setuptools"
        ) from None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=target.parent, prefix=".probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise RuntimeError(
            f"cannot write the compiled allocator to {target.parent} ({exc}); set GRAPHBORROW_CACHE_DIR "
            "to a writable folder"
        ) from None
    partial = None
    try:
        with tempfile.TemporaryDirectory(prefix=".build-sim-", dir=target.parent) as tmp:
            # Cython names the module after its package, so rebuild the package path around it
            package = Path(tmp, "src", *MODULE.split(".")[:-1])
            package.mkdir(parents=True)
            for parent in (package, package.parent):
                (parent / "__init__.py").touch()
            for source in SOURCES:
                shutil.copy(source, package / source.name)
            try:
                extensions = cythonize(
                    [Extension(MODULE, [str(package / "caching.py")])],
                    compiler_directives=CYTHON_DIRECTIVES,
                    quiet=quiet,
                )
            except Exception as exc:  # Cython itself failed (its own message is printed above)
                raise RuntimeError(
                    f"Cython {_cython_version()} could not translate the allocator model ({type(exc).__name__}: "
                    f"{exc}); this is a Cython problem, not a missing compiler: install a release this source "
                    "is tested with (pip install 'cython==3.3.1'). The pure-Python model runs meanwhile"
                ) from exc
            try:
                command = Distribution({"ext_modules": extensions}).get_command_obj("build_ext")
                command.build_lib = str(Path(tmp, "lib"))
                command.build_temp = str(Path(tmp, "obj"))
                command.ensure_finalized()
                command.run()
            except Exception as exc:  # setuptools reports a missing compiler as a CompileError
                raise RuntimeError(
                    f"compiling the allocator model failed ({type(exc).__name__}: {exc}); it needs a C compiler "
                    "(install gcc, or set CC). The pure-Python model runs meanwhile"
                ) from exc
            fd, partial = tempfile.mkstemp(prefix=".sim-allocator-", suffix=EXT_SUFFIX, dir=target.parent)
            os.close(fd)
            shutil.copy(command.get_ext_fullpath(MODULE), partial)
            checksum = _digest(Path(partial))
            os.replace(partial, target)
            partial = None
            fd, partial = tempfile.mkstemp(prefix=".sim-allocator-", suffix=_CHECKSUM, dir=target.parent)
            with os.fdopen(fd, "w") as f:
                f.write(checksum + "\n")
            os.replace(partial, target.with_name(target.name + _CHECKSUM))
            partial = None
    finally:
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)
    return target


def install() -> str:
    """Make ``graphborrow.allocator.caching`` the compiled build when an intact one matches; return :func:`implementation`.

    Runs before the package imports the allocator. Without such a build (or when it does
    not load) pure Python runs, and a RuntimeWarning says why and how to build, unless
    GRAPHBORROW_SIM_PURE=1 asked for pure Python.
    """
    if MODULE in sys.modules or os.environ.get(PURE_ENV, "") not in ("", "0"):
        return implementation()
    path = build_path()
    problem = verify(path)
    if problem is not None:
        _announce(f"the compiled allocator model is not used: {problem}")
        return implementation()
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(MODULE, None)
        _announce(f"the compiled allocator at {path} did not load ({type(exc).__name__}: {exc})")
        return implementation()
    package = sys.modules.get(MODULE.rpartition(".")[0])
    if package is not None:
        package.allocator = module
    return implementation()


def _announce(reason: str) -> None:
    warnings.warn(
        f"{reason}; running the pure-Python model (a few times slower). Build it with: "
        f"python -m graphborrow build --force (or set {PURE_ENV}=1 to choose pure Python)",
        RuntimeWarning,
        stacklevel=3,
    )


def implementation() -> str:
    """``"compiled"`` or ``"pure Python"``: which allocator model this process runs (or will run)."""
    module = sys.modules.get(MODULE)
    if module is None:
        return "pure Python"
    return "compiled" if str(getattr(module, "__file__", "")).endswith(EXT_SUFFIX) else "pure Python"
