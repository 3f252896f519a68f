"""``torch.autocast("cuda")`` on the simulated device casts as torch's CUDA autocast does.

The oracle is torch's own test suite: the op lists of ``torch.testing._internal.autocast_test_lists``
(what ``test/test_cuda.py`` checks on a GPU: each op's inputs and the dtype autocast must give),
read from torch's installed source. The same tests run (marked ``gpu``) on a real GPU.
"""

import importlib.util
import re

import pytest
import torch

from graphborrow import use_device
from graphborrow.sim import cuda_api

# ops without a CPU kernel: the simulated device cannot run them at all (not an autocast question)
NO_CPU_KERNEL = {"cudnn_convolution", "cudnn_convolution_transpose"}
# ops whose CPU kernels lack a half-precision version: with autograd on they reach the device decomposed
LISTS = [("torch_fp16", torch, torch.float16), ("torch_fp32", torch, torch.float32),
         ("torch_need_autocast_promote", torch, torch.float32), ("nn_fp16", torch.nn.functional, torch.float16),
         ("nn_fp32", torch.nn.functional, torch.float32), ("linalg_fp16", torch.linalg, torch.float16),
         ("methods_fp16", torch.Tensor, torch.float16), ("methods_fp32", torch.Tensor, torch.float32)]


def torch_lists(device: str):
    """torch's AutocastTestLists, built on ``device`` (its module imports test-only packages; its
    lists need none of them)."""
    path = importlib.util.find_spec("torch.testing._internal.autocast_test_lists").origin
    source = re.sub(r"^from torch\.testing\._internal\.common_utils import .*$", "", open(path).read(), flags=re.M)
    namespace = {"TEST_WITH_ROCM": False, "TestCase": object}
    exec(compile(source, path, "exec"), namespace)
    return namespace["AutocastTestLists"](device)


@pytest.fixture(params=["sim", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not cuda_api.gpu_available(), reason="needs a CUDA device")])])
def device(request):
    backend = use_device(request.param)
    yield backend
    if backend.simulated:
        cuda_api.uninstall(cuda_api.installed())


def cases(lists):
    for list_name, module, dtype in LISTS:
        for entry in getattr(lists, list_name):
            name, args = entry[0], entry[1]
            if name == "einsum":  # ("einsum", equation, operands)
                args = (entry[1], *entry[2])
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            if list_name.startswith("nn") and not hasattr(module, name):
                module = torch._C._nn
            if name not in NO_CPU_KERNEL and runs_without_autocast(getattr(module, name.replace("linalg_", "")),
                                                                   args, kwargs):
                yield list_name, getattr(module, name.replace("linalg_", "")), args, kwargs, dtype


def runs_without_autocast(fn, args, kwargs) -> bool:
    """Whether the list's arguments suit the op at all (one entry of torch's lists does not: einsum's)."""
    try:
        with torch.inference_mode():
            fn(*args, **kwargs)
    except RuntimeError:
        return False
    return True


def composite(name: str) -> bool:
    """Whether every overload of ``aten::name`` is CompositeImplicitAutograd (decomposed above the device)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return True
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(getattr(packet, overload).name(),
                                                               torch._C.DispatchKey.CompositeImplicitAutograd)
               for overload in packet.overloads())


def output_dtype(fn, args, kwargs, grad_mode):
    with grad_mode(), torch.autocast("cuda"):
        out = fn(*args, **kwargs)
    return (out[0] if isinstance(out, tuple) else out).dtype


def test_every_op_of_torchs_lists_gets_its_dtype_in_inference_mode(device):
    wrong = [(list_name, fn.__name__, got, want) for list_name, fn, args, kwargs, want in cases(torch_lists("cuda"))
             if (got := output_dtype(fn, args, kwargs, torch.inference_mode)) != want]
    assert wrong == []


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.enable_grad], ids=["no_grad", "grad"])
def test_with_autograd_on_the_ops_that_reach_the_device_whole_get_their_dtype(device, grad_mode):
    """With autograd on (no_grad included) a composite op reaches the simulated device already
    decomposed; the ops that reach it whole, and the Python-level ones it models (linear, softmax,
    layer_norm...), are cast by their own rule (softmax kept float16 with grad on: the model called
    the kernel below the op autocast casts)."""
    from graphborrow.sim.tensor import FUNCTION_MODELS

    checked = 0
    for _, fn, args, kwargs, want in cases(torch_lists("cuda")):
        if device.simulated and composite(fn.__name__.strip("_")) and fn not in FUNCTION_MODELS:
            continue
        assert output_dtype(fn, args, kwargs, grad_mode) == want, fn.__name__
        checked += 1
    assert checked >= 40


def test_a_banned_op_is_refused_with_cudas_message(device):
    name, args, module = torch_lists("cuda").banned[0]
    with pytest.raises(RuntimeError, match="unsafe to autocast"), torch.autocast("cuda"):
        getattr(module, name)(*args)


def test_casts_allocate_and_weights_are_cast_once_per_autocast_region(device):
    """CUDA's cached_cast: an fp32 weight's half copy is kept for the region, an activation's is made
    for each op and freed when it returns."""
    layer = torch.nn.Linear(1024, 1024, bias=False, device="cuda")
    x = torch.randn(64, 1024, device="cuda")
    layer(x)  # the first GEMM makes cuBLAS's handle and workspace
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode(), torch.autocast("cuda"):
        first = layer(x)
        kept = torch.cuda.memory_allocated() - base
        second = layer(x)
        again = torch.cuda.memory_allocated() - base
    after = torch.cuda.memory_allocated() - base
    half = 2
    weight, output = 1024 * 1024 * half, 64 * 1024 * half
    assert first.dtype == second.dtype == torch.float16
    assert kept == weight + output  # the input's cast is gone, the weight's is kept
    assert again == weight + 2 * output  # the second call reused the weight's cast
    assert after == 2 * output  # leaving the region dropped it
