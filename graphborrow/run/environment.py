"""Every environment variable graphborrow reads, and one check of them all before work starts.

A variable is read where it takes effect (the arena build, the allocator model, a sweep
worker), often long after a command started: a typo found there costs a capture, a notebook
or a whole sweep. :func:`check_environment` reads each of them up front, with the one rule
its reader applies when it is used (:mod:`graphborrow.core.variables` for the library's own
variables, so Python use refuses them too), and refuses a bad value with the variable, its
value and the fix. The command line, :func:`graphborrow.run.suite.run_suite` and
:func:`graphborrow.run.sweep.run_sweep` call it first. ``docs/reliability.md`` has the table.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Mapping

from graphborrow.core.errors import ParameterError
from graphborrow.core.variables import RULES

__all__ = ["Variable", "VARIABLES", "check_environment", "max_point_bytes", "MAX_POINT_ENV", "FORK_ENV", "STORE_ENV",
           "PURE_ENV", "ALLOC_CONF"]

MAX_POINT_ENV = "GRAPHBORROW_MAX_POINT_MB"
FORK_ENV = "GRAPHBORROW_FORK_KERNELS"  # graphborrow.run.kernels reads it
STORE_ENV = "GRAPHBORROW_SEQUENCE_CACHE"  # graphborrow.planning.stored reads it
# graphborrow.allocator.compiled.PURE_ENV and graphborrow.allocator.config.ENVIRONMENT, named here
# without importing them: that loads the allocator model and torch, which checking a variable
# (and a sweep worker, which imports this module) does not need.
PURE_ENV = "GRAPHBORROW_SIM_PURE"
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def max_point_bytes(environ: Mapping[str, str] | None = None) -> int:
    """How many bytes of executed notebook and results one point may send back.

    Read from ``GRAPHBORROW_MAX_POINT_MB`` (64 when unset). Sweeps call this before any
    point runs, so a bad value costs an error, not a sweep whose every point fails at the end.

    Args:
        environ: where to read the variable (default ``os.environ``).

    Returns:
        The limit in bytes.

    Raises:
        ParameterError: the variable is not a positive, finite number of MiB.
    """
    text = (os.environ if environ is None else environ).get(MAX_POINT_ENV, "64")
    try:
        mb = float(text)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ParameterError(f"{MAX_POINT_ENV}={text!r} must be a positive number of MiB, e.g. 128 "
                             "(or unset it for 64)")
    return max(1, int(mb * (1 << 20)))


@dataclass(frozen=True)
class Variable:
    """One environment variable: who reads it, what it does, and its check (None: any value).

    ``check`` gets the value (the variable is set) and the whole environment, and raises
    ``ValueError`` or ``ParameterError`` naming the problem.
    """

    name: str
    read_by: str
    meaning: str
    check: Callable[[str, Mapping[str, str]], None] | None = None


def _rule(name: str) -> Callable[[str, Mapping[str, str]], None]:
    """The variable's one rule, the one its reader in the library applies (graphborrow.core.variables)."""
    rule = RULES[name]
    return lambda value, _env: rule(value)


def _allocator_settings(_value: str, env: Mapping[str, str]) -> None:
    from graphborrow.allocator.config import AllocatorConfig

    AllocatorConfig.from_environment(env)


def _max_point_mb(_value: str, env: Mapping[str, str]) -> None:
    max_point_bytes(env)


def _dask_connect_timeout(value: str, _env: Mapping[str, str]) -> None:
    try:
        from dask.utils import parse_timedelta
    except ImportError:  # no Dask, no sweep: nothing reads it
        return
    try:
        seconds = parse_timedelta(value, "s")
    except (KeyError, ValueError, TypeError):
        seconds = None
    if seconds is None or not seconds > 0:
        raise ValueError("is not a positive time: write seconds (30) or a number and a unit (30s, 2m)")


VARIABLES: tuple[Variable, ...] = (
    Variable("GRAPHBORROW_CACHE_DIR", "graphborrow.core.native", "where the bump arena and the compiled "
             "allocator model are built (default ~/.cache/graphborrow)", _rule("GRAPHBORROW_CACHE_DIR")),
    Variable("XDG_CACHE_HOME", "graphborrow.core.native", "the cache folder's parent when GRAPHBORROW_CACHE_DIR is "
             "unset", _rule("XDG_CACHE_HOME")),
    # not checked here: a build runs the compiler before anything else and names CC when it fails
    # (the arena falls back to cc, gcc or clang when CC names no program: the build code's rule)
    Variable("CC", "graphborrow.core.arena and the allocator build", "the C compiler of the native builds"),
    Variable(PURE_ENV, "graphborrow.allocator.compiled", "1 runs the pure-Python allocator model instead of the "
             "compiled one", _rule(PURE_ENV)),
    Variable(ALLOC_CONF, "graphborrow.allocator.config (the simulated device, the planner)", "torch's allocator "
             "settings; the simulated device follows them as torch does", _allocator_settings),
    Variable("TRITON_INTERPRET", "graphborrow.eagle.triton.runtime", "1 runs the fused kernels in Triton's interpreter "
             "(set by graphborrow when there is no GPU)", _rule("TRITON_INTERPRET")),
    Variable(MAX_POINT_ENV, "graphborrow.run.sweep.execute", "MiB of executed notebook and results one sweep "
             "point may send back (default 64)", _max_point_mb),
    Variable("CUDA_VISIBLE_DEVICES", "graphborrow.run.sweep.cluster", "the GPUs local sweep workers get, one "
             "each (checked against --workers when the cluster starts)"),
    Variable("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "graphborrow.run.sweep.cluster", "how long a sweep "
             "waits for a --scheduler to answer (Dask's setting, default 30 s)", _dask_connect_timeout),
    Variable("OMP_NUM_THREADS", "graphborrow.run.sweep.execute", "kept for notebook kernels when set; else set "
             "to the CPU cores per worker"),
    Variable("MPLBACKEND", "graphborrow.run.sweep.execute", "removed for notebook kernels, which keep the inline "
             "backend so executed notebooks hold their figures"),
    Variable("JUPYTER_PATH", "graphborrow.run.sweep.execute", "extended with the kernelspec of each point's run"),
    Variable(FORK_ENV, "graphborrow.run.kernels", "0 starts every notebook kernel from scratch instead of forking "
             "it from a warm kernel server", _rule(FORK_ENV)),
    Variable(STORE_ENV, "graphborrow.planning.stored", "0 records every verification step's allocation sequence "
             "instead of reading the ones stored in the cache folder", _rule(STORE_ENV)),
)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Check every variable graphborrow reads that is set; raise on the first bad one.

    Args:
        environ: the environment to check (default ``os.environ``).

    Raises:
        ParameterError: naming the variable, its value, what is wrong and the fix.
    """
    env = os.environ if environ is None else environ
    for variable in VARIABLES:
        value = env.get(variable.name)
        if value is None or variable.check is None:
            continue
        try:
            variable.check(value, env)
        except (ValueError, NotImplementedError) as exc:  # ParameterError is a ValueError
            message = str(exc)
            if not message.startswith(variable.name):
                message = f"{variable.name}={value!r}: {message}"
            raise ParameterError(message) from None
