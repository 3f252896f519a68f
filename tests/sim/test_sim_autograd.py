"""Training on the simulated device: gradients, saved activations, optimizer state, graphed callables.

The oracle is torch on the CPU: the same model, data and steps give the same gradients (on a
backed device) and the same tensors kept alive (gradients, optimizer state: their shapes and
dtypes), and the simulated allocator must hold exactly those tensors' bytes and nothing else
once the step is over (every activation autograd saved is freed by the backward).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphborrow.sim import SimBackend, SimTensor
from graphborrow.sim.cuda_api import simulated_cuda


@pytest.fixture
def backed():
    backend = SimBackend(backed=True, capacity=2**33, blas_workspace=0, blaslt_workspace=0)
    yield backend
    backend.close()


@pytest.fixture(params=[True, False], ids=["backed", "layout-only"])
def device(request):
    backend = SimBackend(backed=request.param, capacity=2**34, blas_workspace=0, blaslt_workspace=0)
    yield backend
    backend.close()


class Net(nn.Module):
    def __init__(self, vocab=300, h=64, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, h)
        self.ln = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)  # a key bias has no gradient: Adam would amplify noise
        self.o = nn.Linear(h, h, bias=False)
        self.rms = nn.RMSNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        b, s, width = h.shape
        q, k, v = self.qkv(self.ln(h)).view(b, s, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, s, width))
        h = h + self.down(F.gelu(self.up(self.rms(h))))
        return self.head(h)


def train(model, ids, targets, optimizer, steps=2, none=True):
    for _ in range(steps):
        logits = model(ids)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=none)
    return loss


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, SimTensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def kept(model, optimizer) -> list:
    out = list(model.parameters())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return out


def state_layout(optimizer) -> list:
    return [sorted((k, tuple(t.shape), t.dtype) for k, t in s.items() if isinstance(t, torch.Tensor))
            for s in optimizer.state.values()]


OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_default": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_training_step_matches_torch_and_the_allocator_holds_what_torch_keeps(backed, name):
    torch.manual_seed(0)
    host = Net()
    ids, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    reference = copy.deepcopy(host)
    ref_opt = OPTIMIZERS[name](reference.parameters())
    with sdpa_kernel([SDPBackend.MATH]):
        ref_loss = train(reference, ids, targets, ref_opt)
    model = host.cuda()
    opt = OPTIMIZERS[name](model.parameters())
    loss = train(model, ids.cuda(), targets.cuda(), opt)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-4)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), r, rtol=1e-4, atol=1e-5)
    assert state_layout(opt) == state_layout(ref_opt)
    del loss
    assert backed.memory_stats()["requested_bytes.all.current"] == tensor_bytes(kept(model, opt))


def test_zero_grad_keeps_or_frees_the_gradients_as_asked(device):
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 300, (2, 16), device="cuda")
    train(model, ids, ids, opt, steps=1, none=False)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    held = device.memory_stats()["requested_bytes.all.current"]
    assert held == tensor_bytes(kept(model, opt) + [ids])
    opt.zero_grad(set_to_none=True)
    del grads
    assert device.memory_stats()["requested_bytes.all.current"] == held - tensor_bytes(
        p for p in model.parameters())  # the gradients were the parameters' size


def test_the_backward_frees_every_saved_activation(device):
    model = Net().cuda()
    ids = torch.randint(0, 300, (4, 32), device="cuda")
    before = device.memory_stats()["requested_bytes.all.current"]
    loss = F.cross_entropy(model(ids).float().view(-1, 300), ids.view(-1))
    assert device.memory_stats()["requested_bytes.all.current"] > before + 4 * 32 * 300 * 4  # logits and more
    loss.backward()
    del loss
    grads = tensor_bytes(p.grad for p in model.parameters())
    assert device.memory_stats()["requested_bytes.all.current"] == before + grads


@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                     SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH])
def test_attention_gradients_under_every_backend_are_torchs(backed, backend):
    torch.manual_seed(0)
    base = [torch.randn(2, 4, 16, 32) for _ in range(3)]

    def grads(dev, chosen):
        q, k, v = (t.clone().to(dev, torch.bfloat16).requires_grad_(True) for t in base)
        with sdpa_kernel([chosen]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out.float() * torch.arange(32.0, device=dev)).sum().backward()
        return [t.grad.cpu() for t in (q, k, v)]

    for got, expected in zip(grads("cuda", backend), grads("cpu", SDPBackend.MATH)):
        torch.testing.assert_close(got, expected)


def test_graphed_callables_train_as_eager_code_does(backed):
    """Forward and backward graphs captured into one pool, replayed each step: the same parameters
    as the same steps run eagerly on the CPU."""
    torch.manual_seed(0)
    host = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))
    reference = copy.deepcopy(host)
    batches = [torch.randn(8, 32) for _ in range(3)]
    model = host.cuda()
    sample = torch.randn(8, 32, device="cuda", requires_grad=True)
    with simulated_cuda(backed):  # make_graphed_callables reaches torch.cuda's graphs
        graphed = torch.cuda.make_graphed_callables(model, (sample,))
        pools = {s["segment_pool_id"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0)}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in batches:
            graphed(x.cuda()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in batches:
        reference(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert len(pools) == 1  # the forward and the backward graph share one pool
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), r, rtol=1e-4, atol=1e-5)
