"""The allocator model compiled by Cython: the same source, a few times faster.

``allocator.py`` is the model and stays plain Python; ``allocator.pxd`` beside it gives
Cython C types for the hot classes and locals. ``python -m graphborrow build``
builds an extension module from the two into the cache directory, named by a hash of
both files and of the interpreter, so a build can never be stale: edit either file and
the old build is simply not found. When ``graphborrow.sim`` is imported, :func:`install`
loads a matching build if there is one and leaves the pure-Python module otherwise.
Set ``GRAPHBORROW_SIM_PURE=1`` to run pure Python even when a build exists.

Both run the same rules; ``tests/test_sim_compiled.py`` checks them against each other
operation by operation.
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
from pathlib import Path

from ..arena import cache_dir

MODULE = "graphborrow.sim.allocator"
HERE = Path(__file__).parent
SOURCES = (HERE / "allocator.py", HERE / "allocator.pxd")
PURE_ENV = "GRAPHBORROW_SIM_PURE"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
CYTHON_DIRECTIVES = {"language_level": 3, "annotation_typing": False}


def build_tag(sources: tuple[Path, ...] = SOURCES) -> str:
    """Hash of the sources and the interpreter that names a build."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    digest.update(f"{sys.implementation.cache_tag}{EXT_SUFFIX}{platform.machine()}".encode())
    return digest.hexdigest()[:16]


def build_path() -> Path:
    return cache_dir() / f"sim-allocator-{build_tag()}{EXT_SUFFIX}"


def build(force: bool = False, quiet: bool = True) -> Path:
    """Compile the allocator model unless a build of these sources exists; return its path.

    Needs Cython and a C compiler. The file appears by an atomic rename, so concurrent
    builds race harmlessly.
    """
    target = build_path()
    if target.exists() and not force:
        return target
    try:
        from Cython.Build import cythonize
        from setuptools import Distribution, Extension
    except ImportError as exc:
        raise RuntimeError(
            f"building the compiled allocator needs Cython and setuptools ({exc}); "
            "install them with: pip install 'cython>=3' setuptools"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-sim-", dir=target.parent) as tmp:
        # Cython names the module after its package, so rebuild the package path around it
        package = Path(tmp, "src", *MODULE.split(".")[:-1])
        package.mkdir(parents=True)
        for parent in (package, package.parent):
            (parent / "__init__.py").touch()
        for source in SOURCES:
            shutil.copy(source, package / source.name)
        extensions = cythonize(
            [Extension(MODULE, [str(package / "allocator.py")])],
            compiler_directives=CYTHON_DIRECTIVES,
            quiet=quiet,
        )
        command = Distribution({"ext_modules": extensions}).get_command_obj("build_ext")
        command.build_lib = str(Path(tmp, "lib"))
        command.build_temp = str(Path(tmp, "obj"))
        command.ensure_finalized()
        try:
            command.run()
        except Exception as exc:
            raise RuntimeError(f"compiling the allocator model failed: {exc}") from exc
        fd, partial = tempfile.mkstemp(prefix=".sim-allocator-", suffix=EXT_SUFFIX, dir=target.parent)
        os.close(fd)
        shutil.copy(command.get_ext_fullpath(MODULE), partial)
        os.replace(partial, target)
    return target


def install() -> str:
    """Make ``graphborrow.sim.allocator`` the compiled build when one matches; return :func:`implementation`.

    Runs before the package imports the allocator. A build that fails to load is
    reported with a warning and pure Python is used; nothing else changes.
    """
    if MODULE in sys.modules or os.environ.get(PURE_ENV, "") not in ("", "0"):
        return implementation()
    path = build_path()
    if not path.exists():
        return implementation()
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(MODULE, None)
        warnings.warn(
            f"the compiled allocator at {path} did not load ({type(exc).__name__}: {exc}); "
            "running the pure-Python model. Rebuild it with: python -m graphborrow build --force",
            RuntimeWarning,
            stacklevel=2,
        )
        return implementation()
    package = sys.modules.get(MODULE.rpartition(".")[0])
    if package is not None:
        package.allocator = module
    return implementation()


def implementation() -> str:
    """``"compiled"`` or ``"pure Python"``: which allocator model this process runs (or will run)."""
    module = sys.modules.get(MODULE)
    if module is None:
        return "pure Python"
    return "compiled" if str(getattr(module, "__file__", "")).endswith(EXT_SUFFIX) else "pure Python"
