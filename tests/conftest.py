"""Shared fixtures: a backend per device kind, and a small graph ladder to borrow from."""

import gc
import os

import torch

if not torch.cuda.is_available():
    # The fused kernels run in Triton's interpreter here, which must be chosen before anything
    # (a library, another test module) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from graphborrow.backend import get_backend  # noqa: E402
from graphborrow.borrow import BorrowState  # noqa: E402

MiB = 1 << 20


def _cuda_param():
    return pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/ on a GPU machine)"),
        ],
    )


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
