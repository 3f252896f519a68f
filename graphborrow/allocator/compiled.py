"""The allocator model compiled by Cython: the same source, a few times faster.

``stats.py``, ``blocks.py`` and ``caching.py`` are the model and stay plain Python; the
``.pxd`` beside each gives Cython C types for the hot classes and locals (``caching.pxd``
cimports the other two, so the allocator reaches blocks and statistics as C structs).
``python -m graphborrow build`` builds one extension module from each into the native-build
cache (:mod:`graphborrow.core.native`), named by a hash of all six files, the interpreter,
the Cython version and the compiler directives, so a build can never be stale. A build whose
bytes do not match its digest (a truncated or damaged file) is never loaded.

When ``graphborrow.allocator`` is imported, :func:`install` loads a matching, intact build of
all three modules and otherwise runs the pure-Python model, saying so once (set
``GRAPHBORROW_SIM_PURE=1`` to choose pure Python on purpose, silently). Both run the same
rules; ``tests/allocator/test_compiled_model.py`` checks them against each other operation by
operation.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import types
import warnings
from importlib import metadata
from pathlib import Path

from graphborrow.core import native, variables

__all__ = ["MODULES", "PURE_ENV", "SOURCES", "build", "build_paths", "build_tag", "implementation", "install",
           "problem", "pure_model"]

PACKAGE = "graphborrow.allocator"
MODULES = ("stats", "blocks", "caching")  # in load order: each cimports those before it
HERE = Path(__file__).parent
SOURCES = tuple(HERE / f"{module}.{ext}" for module in MODULES for ext in ("py", "pxd"))
PURE_ENV = "GRAPHBORROW_SIM_PURE"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
CYTHON_DIRECTIVES = {"language_level": 3, "annotation_typing": False}


def _cython_version() -> str:
    try:
        return metadata.version("Cython")
    except metadata.PackageNotFoundError:
        return "none"


def build_tag(sources: tuple[Path, ...] = SOURCES) -> str:
    """Hash of what a build depends on: the sources, the interpreter, Cython and its directives."""
    return native.content_tag(
        *(path.read_bytes() for path in sources),
        f"{sys.implementation.cache_tag}{EXT_SUFFIX}{platform.machine()}".encode(),
        f"cython {_cython_version()} {sorted(CYTHON_DIRECTIVES.items())}".encode(),
    )


def build_paths() -> dict[str, Path]:
    """Module name -> where its build of these sources lives (or will) in the cache."""
    tag = build_tag()
    return {module: native.cache_dir() / f"sim-{module}-{tag}{EXT_SUFFIX}" for module in MODULES}


def problem() -> str | None:
    """Why the build of these sources must not be loaded (missing, no checksum, damaged), or None when intact."""
    for path in build_paths().values():
        reason = native.problem(path)
        if reason is not None:
            return reason
    return None


def build(force: bool = False, quiet: bool = True) -> dict[str, Path]:
    """Compile the allocator model unless an intact build of these sources exists; return its paths.

    Needs Cython, setuptools, a C compiler and a writable cache directory; raises
    RuntimeError naming what is missing. Each module appears by atomic renames (file, then
    digest), so concurrent builds race harmlessly and an interrupted one leaves nothing that
    would be loaded; temporaries are removed whatever happens.

    Args:
        force: rebuild even when an intact build exists.
        quiet: hide Cython's own output.

    Returns:
        Module name -> path of its verified build.

    Raises:
        RuntimeError: Cython or setuptools is missing, Cython failed, the compiler failed, or
            the cache is not writable.
    """
    targets = build_paths()
    if not force and problem() is None:
        return targets
    try:
        from Cython.Build import cythonize
        from setuptools import Distribution, Extension
    except ImportError as exc:
        raise RuntimeError(
            f"building the compiled allocator needs Cython and setuptools ({exc}); "
            "install them with: pip install 'cython>=3' setuptools"
        ) from None

    def make(tmp: Path) -> list[Path]:
        source_root = tmp / "src"  # Cython names modules after their package: rebuild the package path
        package = source_root.joinpath(*PACKAGE.split("."))
        package.mkdir(parents=True)
        for parent in (package, package.parent):
            (parent / "__init__.py").touch()
        for source in SOURCES:
            shutil.copy(source, package / source.name)
        try:
            extensions = cythonize(
                [Extension(f"{PACKAGE}.{module}", [str(package / f"{module}.py")], extra_compile_args=["-g0"])
                 for module in MODULES],
                compiler_directives=CYTHON_DIRECTIVES, include_path=[str(source_root)], quiet=quiet,
                nthreads=_jobs(),
            )
        except Exception as exc:  # Cython itself failed (its own message is printed above)
            raise RuntimeError(
                f"Cython {_cython_version()} could not translate the allocator model ({type(exc).__name__}: "
                f"{exc}); this is a Cython problem, not a missing compiler: install a release this source "
                "is tested with (pip install 'cython==3.3.1'). The pure-Python model runs meanwhile"
            ) from exc
        try:
            command = Distribution({"ext_modules": extensions}).get_command_obj("build_ext")
            command.build_lib = str(tmp / "lib")
            command.build_temp = str(tmp / "obj")
            command.parallel = _jobs()  # the three modules compile side by side
            command.ensure_finalized()
            command.run()
        except Exception as exc:  # setuptools reports a missing compiler as a CompileError
            raise RuntimeError(
                f"compiling the allocator model failed ({type(exc).__name__}: {exc}); it needs a C compiler "
                "(install gcc, or set CC). The pure-Python model runs meanwhile"
            ) from exc
        built = []
        for module, target in targets.items():
            built.append(tmp / target.name)
            shutil.copy(command.get_ext_fullpath(f"{PACKAGE}.{module}"), built[-1])
        return built

    native.build(list(targets.values()), make, "the compiled allocator build cache", force=True)
    return targets


def _jobs() -> int:
    """Processes for the build: the cores this process may use, at most one per module."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, len(MODULES)))


def install() -> str:
    """Make the allocator modules their compiled builds when an intact build matches; return :func:`implementation`.

    Runs before the package imports the allocator. All three modules load, or none: the
    compiled allocator reaches the compiled blocks and statistics through C. Without such a
    build (or when it does not load) pure Python runs, and a RuntimeWarning says why and
    how to build, unless GRAPHBORROW_SIM_PURE=1 asked for pure Python.
    """
    names = [f"{PACKAGE}.{module}" for module in MODULES]
    if any(name in sys.modules for name in names) or variables.read(PURE_ENV, "") not in ("", "0"):
        return implementation()
    reason = problem()
    if reason is not None:
        _announce(f"the compiled allocator model is not used: {reason}")
        return implementation()
    paths = build_paths()
    try:
        for module, name in zip(MODULES, names):
            spec = importlib.util.spec_from_file_location(name, paths[module])
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded
            spec.loader.exec_module(loaded)
    except Exception as exc:
        for name in names:
            sys.modules.pop(name, None)
        _announce(f"the compiled allocator in {paths[module].parent} did not load ({type(exc).__name__}: {exc})")
        return implementation()
    package = sys.modules.get(PACKAGE)
    if package is not None:
        for module, name in zip(MODULES, names):
            setattr(package, module, sys.modules[name])
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
    module = sys.modules.get(f"{PACKAGE}.caching")
    if module is None:
        return "pure Python"
    return "compiled" if str(getattr(module, "__file__", "")).endswith(EXT_SUFFIX) else "pure Python"


def pure_model() -> types.ModuleType:
    """The allocator model run from its Python source, whatever build this process loaded.

    Returns ``caching`` as a module of its own (``pure_source.caching`` beside the package), with
    pure ``stats`` and ``blocks`` and the modules built on them, sharing the rest (memory,
    streams, configuration, errors) with the package. For checking the build against its
    source in one process.

    Returns:
        The pure-Python ``caching`` module.
    """
    from . import config, errors, memory, streams  # (they import none of MODULES: shared as they are)

    name = f"{PACKAGE}.pure_source"
    caching = sys.modules.get(f"{name}.caching")
    if caching is None:
        package = types.ModuleType(name)
        package.__path__ = [str(HERE)]  # its other modules (stats, blocks, ...) load from their source
        sys.modules[name] = package
        for module in (config, memory, streams, errors):
            sys.modules[f"{name}.{module.__name__.rpartition('.')[2]}"] = module
        spec = importlib.util.spec_from_file_location(f"{name}.caching", HERE / "caching.py")
        caching = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(caching)
    return caching
