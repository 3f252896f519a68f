"""``graphborrow.use_device``: a notebook's first line, re-run any number of times."""

import pytest
import torch

from graphborrow import use_device
from graphborrow.core.errors import ParameterError
from graphborrow.sim import cuda_api

NO_GPU = pytest.mark.skipif(cuda_api.gpu_available(), reason="this machine has a GPU")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not cuda_api.gpu_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def nothing_stays_installed():
    yield
    while cuda_api.installed() is not None:
        cuda_api.uninstall(cuda_api.installed())


@NO_GPU
def test_auto_without_a_gpu_installs_the_simulated_device_once():
    backend = use_device("auto")
    assert backend.simulated and "simulated CUDA device" in backend.describe()
    sim = cuda_api.installed()
    assert sim.backend is backend and torch.cuda.is_available()
    patched = torch.cuda.memory_snapshot
    again = use_device("auto")  # the cell run again
    assert again is backend and torch.cuda.memory_snapshot is patched
    assert cuda_api.installed() is sim  # no second install
    assert torch.empty(3, device="cuda").data_ptr() != 0


@NO_GPU
def test_other_arguments_install_a_fresh_device_in_its_place():
    backed = use_device("sim")
    layout = use_device("sim", layout_only=True, capacity=2**34)
    assert layout is not backed and not layout.backed and layout.capacity == 2**34
    assert cuda_api.installed().backend is layout
    assert torch.cuda.mem_get_info()[1] == 2**34
    cuda_api.uninstall(cuda_api.installed())
    assert cuda_api.installed() is None  # in its place, not nested inside the first


@NO_GPU
def test_cuda_without_a_gpu_is_refused_even_when_the_simulated_device_answers():
    use_device("sim")
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        use_device("cuda")
    assert cuda_api.installed() is not None  # nothing was undone by the refusal


def test_bad_arguments_are_named():
    with pytest.raises(ParameterError, match="'auto', 'cuda' or 'sim'"):
        use_device("gpu")
    with pytest.raises(ParameterError, match="capacity"):
        use_device("sim", capacity=0)
    with pytest.raises(ParameterError, match="2\\*\\*63"):
        use_device("sim", capacity=2**64)


@pytest.mark.parametrize("kind", [pytest.param("auto", marks=GPU), pytest.param("cuda", marks=GPU)])
def test_a_gpu_keeps_its_own_torch_cuda(kind):
    before = {name: getattr(torch.cuda, name) for name in ("is_available", "memory_snapshot", "MemPool", "graph")}
    backend = use_device(kind)
    assert not backend.simulated and backend is use_device(kind)
    assert {name: getattr(torch.cuda, name) for name in before} == before and cuda_api.installed() is None
    with pytest.raises(ParameterError, match="layout_only=True applies to the simulated device"):
        use_device(kind, layout_only=True)


@NO_GPU
def test_auto_means_the_device_torch_cuda_answers_for():
    from graphborrow.device import cuda_available, get_backend

    backend = use_device("sim", layout_only=True)
    assert not cuda_available()  # torch's own answer, not the install's
    assert get_backend("auto") is backend and get_backend("sim") is not backend
