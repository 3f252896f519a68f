"""Shared fixtures: a backend per device kind, and a small graph ladder to borrow from.

Also the Hypothesis profiles, chosen by ``GRAPHBORROW_HYPOTHESIS``:

- ``ci`` (the default, what ``make test`` runs): each property test draws the same examples
  on every run (derandomised, no example database), so a failure in CI is reproduced by
  running the same command again;
- ``search`` (``make test-deep``): the same numbers of examples, drawn at random from the
  seed ``--hypothesis-seed`` gives (the target prints it, and a failure prints the command
  that replays it);
- ``deep`` (``make deep``): 50 times as many examples, at random, including tests that ask
  for a number of their own; :func:`deep_factor` scales randomized stress loops with it.

Every test starts from the same random state (``torch``, ``random``), so tests that draw
their inputs without a generator draw the same ones every run. Property tests are marked
``property`` automatically, so ``pytest -m property`` selects them.
"""

import gc
import importlib.util
import os
import random
import signal
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

# A runner that starts the suite as a background job (a shell without job control, nohup in a
# script) leaves SIGINT ignored, and every process it starts inherits that: Python then installs
# no KeyboardInterrupt handler, and the tests of Ctrl-C (in this process and in the commands they
# start) would test nothing. Python's own handler, as an interactive start gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    # The fused kernels run in Triton's interpreter here, which must be chosen before anything
    # (a library, another test module) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from graphborrow.core.borrow import BorrowState  # noqa: E402
from graphborrow.device import get_backend  # noqa: E402

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """Import one of the repository's scripts (``scripts/x.py``, ``benchmarks/y.py``) as a module."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

HYPOTHESIS_ENV = "GRAPHBORROW_HYPOTHESIS"
DEEP_FACTOR = 50
CI_EXAMPLES = 100
# Each profile starts from Hypothesis's own defaults, not from the settings loaded at import: on a
# machine with CI set, Hypothesis loads its built-in derandomised profile first, which the search
# would otherwise inherit (and draw the CI examples whatever its seed).
_BASE = settings.get_profile("default")
settings.register_profile("ci", _BASE, max_examples=CI_EXAMPLES, deadline=None, print_blob=True, derandomize=True,
                          database=None)
settings.register_profile("search", _BASE, max_examples=CI_EXAMPLES, deadline=None, print_blob=True,
                          derandomize=False, database=None)
settings.register_profile(
    "deep",
    _BASE,
    max_examples=CI_EXAMPLES * DEEP_FACTOR,
    deadline=None,
    print_blob=True,
    derandomize=False,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILES = ("ci", "search", "deep")
PROFILE = os.environ.get(HYPOTHESIS_ENV, "ci")
if PROFILE not in PROFILES:
    raise pytest.UsageError(f"{HYPOTHESIS_ENV}={PROFILE!r}: choose one of {PROFILES} ('ci' is the default)")
settings.load_profile(PROFILE)


def deep_factor() -> int:
    """How many times longer randomized tests run: 1, or 50 under the deep profile."""
    return DEEP_FACTOR if PROFILE == "deep" else 1


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test starts from one random state, whatever ran before it on its worker."""
    random.seed(0)
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After a failed random search, the command that replays it (the seed, the failed tests)."""
    if PROFILE == "ci" or exitstatus == 0:
        return
    seed = config.getoption("hypothesis_seed", None)
    failed = [report.nodeid for report in terminalreporter.stats.get("failed", [])]
    if seed is None or not failed:
        return
    terminalreporter.write_line(
        f"replay this search: {HYPOTHESIS_ENV}={PROFILE} python -m pytest -p no:cacheprovider "
        f"--hypothesis-seed={seed} " + " ".join(sorted(set(failed))))


def pytest_collection_modifyitems(config, items):
    # Modules marked slow first: pytest-xdist (--dist loadscope --no-loadscope-reorder) hands
    # whole modules to its two workers in this order, so the long ones start early and the
    # short ones even out the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        test = getattr(item, "obj", None)
        if getattr(test, "hypothesis", None) is None:
            continue
        item.add_marker(pytest.mark.property)
        if PROFILE != "deep":
            continue
        # a test that asked for its own number of examples gets 50 times that number too
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is None:
            raise pytest.UsageError(
                "the deep profile cannot scale per-test example counts with this Hypothesis version "
                f"({item.nodeid}); run with {HYPOTHESIS_ENV}=ci or update tests/conftest.py"
            )
        if own.max_examples != settings.default.max_examples:
            test._hypothesis_internal_use_settings = settings(own, max_examples=own.max_examples * DEEP_FACTOR)


def _cuda_param():
    return pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/ on a GPU machine)"),
        ],
    )


def free_while_a_side_stream_uses(sim, state, nbytes: int, user: str = "t") -> None:
    """Borrow ``nbytes`` of float32 from ``state``, hand the tensor to a side stream still
    busy (``sim.sleep``) and free it: its block stays pending until that stream's event."""
    side = sim.Stream()
    with state.borrow(user):
        t = torch.ones(nbytes // 4, device=sim.device)
        sim.sleep(side, 1000)
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            t.mul_(2)
        sim.record_stream(t, side)
        del t


@pytest.fixture
def sim():
    """A fresh simulated device of 1 GiB, closed after the test."""
    from graphborrow.sim import SimBackend

    backend = SimBackend(capacity=2**30)
    yield backend
    backend.close()


@pytest.fixture(params=["sim", _cuda_param()])
def backend(request):
    """The simulated device (always) and the real GPU (marked ``gpu``)."""
    b = get_backend(request.param)
    yield b
    gc.collect()
    if request.param == "sim":
        b.close()
    else:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Ladder:
    """Graphs captured largest first into one shared pool; their intermediates leave runs.

    Each graph computes ``out = ((x * 2) + 1)[:8]`` over ``n`` float32 elements: the two
    full-size intermediates die inside the capture and stay behind as free blocks.
    """

    def __init__(self, backend, state: BorrowState, sizes_mib=(128, 96)):
        self.backend, self.state = backend, state
        self.graphs, self.inputs, self.outputs = [], [], []
        for size in sizes_mib:
            x = torch.ones(size * MiB // 4, device=backend.device)
            g = backend.CUDAGraph()
            with state.capture_scope(), backend.graph(g, pool=state.pool_id):
                t = x * 2
                u = t + 1
                out = u[:8].clone()
                del t, u
            self.graphs.append(g)
            self.inputs.append(x)
            self.outputs.append(out)
        backend.synchronize()

    def replay(self, i=0):
        with self.state.replay_scope():
            self.graphs[i].replay()
        self.backend.synchronize()


@pytest.fixture
def ladder(backend):
    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    lad = Ladder(backend, state)
    yield lad
    lad.graphs.clear()


def pytest_collection_finish(session):
    # Everything imported and collected so far lives for the whole run: keep it out of the
    # cyclic collector, so each gc.collect() (a simulated graph capture runs one, as
    # torch.cuda.graph does) walks only what the tests made.
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # back to the collector, so interpreter shutdown frees them as usual
