"""Training with graphed callables, and ``torch.compile``'s CUDA graphs, as users write them.

``torch.cuda.make_graphed_callables`` captures a module's forward and backward into graphs that
share one pool; ``torch.compile(..., backend="cudagraphs")`` and ``mode="reduce-overhead"`` hand
the compiled graph to CUDAGraph Trees, which keeps one pool per device for every graph it
records, checkpoints it between recordings and reuses it across shapes. Each script here is
one such program: the pools it leaves are what the simulated device must reproduce, or refuse
by name at the call.
"""

from __future__ import annotations

from .generate import Program

__all__ = ["compiled_programs"]

_MLP = """import torch
import torch.nn.functional as F

torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self, h, inner):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, inner)
        self.down = torch.nn.Linear(inner, h)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


"""

_SCRIPTS = {
    # make_graphed_callables around two blocks (the second's input requires grad), trained three steps
    "graphed_blocks_training": _MLP + """h, inner = 1024, 4096
first, second = Block(h, inner).cuda(), Block(h, inner).cuda()
head = torch.nn.Linear(h, 1000).cuda()
x = torch.randn(16, 128, h, device='cuda')
mid = torch.randn(16, 128, h, device='cuda', requires_grad=True)
first, second = torch.cuda.make_graphed_callables((first, second), ((x,), (mid,)))
params = [p for m in (first, second, head) for p in m.parameters()]
opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
for step in range(3):
    x = torch.randn(16, 128, h, device='cuda')
    y = torch.randint(0, 1000, (16 * 128,), device='cuda')
    out = head(second(first(x)))
    loss = F.cross_entropy(out.view(-1, 1000), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
""",
    # torch's documentation example: three modules graphed separately, SGD
    "graphed_modules_docs": """import torch
from itertools import chain

torch.manual_seed(0)
N, D_in, H, D_out = 640, 4096, 2048, 1024
module1 = torch.nn.Linear(D_in, H).cuda()
module2 = torch.nn.Linear(H, D_out).cuda()
module3 = torch.nn.Linear(H, D_out).cuda()
loss_fn = torch.nn.MSELoss()
optimizer = torch.optim.SGD(chain(module1.parameters(), module2.parameters(), module3.parameters()), lr=0.1)
x = torch.randn(N, D_in, device='cuda')
h = torch.randn(N, H, device='cuda', requires_grad=True)
module1 = torch.cuda.make_graphed_callables(module1, (x,))
module2 = torch.cuda.make_graphed_callables(module2, (h,))
module3 = torch.cuda.make_graphed_callables(module3, (h,))
for step in range(4):
    optimizer.zero_grad(set_to_none=True)
    tmp = module1(torch.randn(N, D_in, device='cuda'))
    tmp = module2(tmp) if step % 2 == 0 else module3(tmp)
    loss = loss_fn(tmp, torch.randn(N, D_out, device='cuda'))
    loss.backward()
    optimizer.step()
torch.cuda.synchronize()
""",
    "cudagraphs_inference": _MLP + """model = torch.nn.Sequential(Block(1024, 4096), Block(1024, 4096)).cuda().eval()
compiled = torch.compile(model, backend="cudagraphs")
outputs = []
with torch.no_grad():
    for batch in (8, 8, 8, 16, 16, 8):
        outputs.append(compiled(torch.randn(batch, 1024, device='cuda')))
torch.cuda.synchronize()
""",
    "cudagraphs_training": _MLP + """model = torch.nn.Sequential(Block(1024, 4096), Block(1024, 4096)).cuda()
compiled = torch.compile(model, backend="cudagraphs")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    out = compiled(torch.randn(32, 1024, device='cuda'))
    out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
""",
    "reduce_overhead_inference": _MLP + """model = torch.nn.Sequential(Block(1024, 4096), Block(1024, 4096)).cuda().eval()
compiled = torch.compile(model, mode="reduce-overhead")
outputs = []
with torch.no_grad():
    for batch in (8, 8, 8, 16, 16, 8):
        outputs.append(compiled(torch.randn(batch, 1024, device='cuda')).clone())
torch.cuda.synchronize()
""",
    "reduce_overhead_training": _MLP + """model = torch.nn.Sequential(Block(1024, 4096), Block(1024, 4096)).cuda()
compiled = torch.compile(model, mode="reduce-overhead")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
for step in range(4):
    out = compiled(torch.randn(32, 1024, device='cuda'))
    out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
""",
}


def compiled_programs() -> list[Program]:
    """The scripts above (named ``compile_<name>``), in a fixed order."""
    return [Program(name=f"compile_{name}", kind="compile", source=source) for name, source in _SCRIPTS.items()]
