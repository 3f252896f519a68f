"""Module conversions onto the simulated device keep tied parameters one tensor, as torch does.

The oracle is torch itself: the same host module converted to float64, which copies every
tensor through ``Module._apply``'s in-place path (``param.data = ...``) exactly as moving a host
module to a GPU does. Which slots share a tensor after the conversion must be the same on the
simulated device, and its allocator must hold each distinct tensor once.
"""

import copy

import pytest
import torch
import torch.nn as nn
import transformers

from graphborrow.sim import SimBackend

MODES = [pytest.param(True, id="backed"), pytest.param(False, id="layout-only")]


@pytest.fixture(params=MODES)
def device(request):
    backend = SimBackend(backed=request.param, capacity=2**34)
    yield backend
    backend.close()


class Tied(nn.Module):
    """An embedding and a head sharing one weight, a buffer registered in two modules, and a
    parameter shared by two layers of a list."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight
        shared = torch.arange(64, dtype=torch.float32)
        self.a, self.b = nn.Module(), nn.Module()
        self.a.register_buffer("table", shared)
        self.b.register_buffer("table", shared)
        self.layers = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
        self.layers[1].bias = self.layers[0].bias


def ties(module: nn.Module) -> list[list[str]]:
    """Groups of slot names (parameters and buffers) holding the same tensor object."""
    groups: dict[int, list[str]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for kind in (m._parameters, m._buffers):
            for key, t in kind.items():
                if t is not None:
                    groups.setdefault(id(t), []).append(f"{prefix}.{key}".lstrip("."))
    return sorted(sorted(set(g)) for g in groups.values())


def distinct_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for _, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def copied_on_the_host(module: nn.Module) -> nn.Module:
    """torch's own answer: a conversion that copies every tensor, on the host."""
    return copy.deepcopy(module).to(torch.float64)


CONVERSIONS = {
    "cuda": lambda m: m.cuda(),
    "to_bf16": lambda m: m.to("cuda", torch.bfloat16),
    "to_then_half": lambda m: m.to("cuda").half(),
    "bf16_on_host_then_cuda": lambda m: m.bfloat16().cuda(),
}


@pytest.mark.parametrize("name", CONVERSIONS)
def test_tied_parameters_stay_one_tensor_as_torch_keeps_them(device, name):
    host = Tied()
    with torch.no_grad():
        host.emb.weight.grad = torch.ones_like(host.emb.weight)  # a gradient travels with its parameter
    reference = copied_on_the_host(host)
    moved = CONVERSIONS[name](host)
    assert ties(moved) == ties(reference)
    assert moved.emb.weight is moved.head.weight and moved.layers[0].bias is moved.layers[1].bias
    assert moved.a.table is not moved.b.table  # torch replaces a buffer in each module that holds it
    assert moved.emb.weight.grad is not None and moved.emb.weight.grad.sim_storage is not None
    grads = moved.emb.weight.numel() * moved.emb.weight.element_size()
    assert device.memory_stats()["requested_bytes.all.current"] == distinct_bytes(moved) + grads
    assert distinct_bytes(moved) == distinct_bytes(reference) // 8 * moved.emb.weight.element_size()


def test_a_tied_transformers_model_holds_its_embedding_once(device):
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=5000, n_positions=64)
    host = transformers.GPT2LMHeadModel(config)
    reference = copied_on_the_host(host)
    model = host.to("cuda", torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert ties(model) == ties(reference)
    held = device.memory_stats()["requested_bytes.all.current"]
    assert held == distinct_bytes(model) == distinct_bytes(reference) // 4  # bfloat16 against float64
    model.tie_weights()  # tying again on the device changes nothing
    assert device.memory_stats()["requested_bytes.all.current"] == held


def test_modules_off_the_simulated_device_convert_as_before():
    host = Tied()
    expected = ties(copied_on_the_host(host))
    assert ties(host.to(torch.float64)) == expected and host.emb.weight.dtype == torch.float64
    assert ties(host.to("meta")) == ties(Tied().to("meta"))  # torch's own rules wherever the sim is not the target
