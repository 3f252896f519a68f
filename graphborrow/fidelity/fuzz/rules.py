"""CUDA's capture rules as small programs: what a graph capture refuses and what it accepts.

Each program does one thing inside ``torch.cuda.graph`` (or, for ``pin_memory``, outside
it). Recorded on the H200, the error each one ends with, or none, is what the simulated
device must reproduce, message and line: a simulator that lets through a capture the GPU
refuses tells a user their engine works when it does not.
"""

from __future__ import annotations

from .generate import Program

__all__ = ["RULES", "rule_programs"]

_SETUP = """import torch
x = torch.arange(8, device="cuda", dtype=torch.float32)
host = torch.ones(8)
out = torch.empty(8, device="cuda")
g = torch.cuda.CUDAGraph()
"""

# name -> what the capture body does (indented under ``with torch.cuda.graph(g):``), or a whole
# program after the setup when it starts with "#whole"
RULES: dict[str, str] = {
    # refused: host data, syncs, reads of device values
    "tensor_from_python": "y = x + torch.tensor(1.0, device='cuda')",
    "tensor_list_from_python": "y = torch.tensor([1.0, 2.0], device='cuda')",
    "as_tensor_from_python": "y = torch.as_tensor([1, 2], device='cuda')",
    "new_tensor": "y = x.new_tensor([1.0, 2.0])",
    "pageable_to_cuda": "y = host.to('cuda')",
    "pageable_cuda_method": "y = host.cuda()",
    "pageable_non_blocking": "y = host.to('cuda', non_blocking=True)",
    "pageable_copy_into_device": "out.copy_(host)",
    "device_to_pageable": "c = x.cpu()",
    "item": "v = x.sum().item()",
    "tolist": "v = x.tolist()",
    "bool_of_tensor": "b = bool((x > 0).any())",
    "repr_of_tensor": "r = repr(x)",
    "synchronize": "torch.cuda.synchronize()",
    "stream_synchronize": "torch.cuda.current_stream().synchronize()",
    "event_synchronize": "e = torch.cuda.Event()\n    e.record()\n    e.synchronize()",
    "nonzero": "n = x.nonzero()",
    "boolean_index": "y = x[x > 2]",
    "masked_select": "y = x.masked_select(x > 2)",
    "plain_cpu_operand": "y = x + torch.ones(8)",
    "pin_memory_inside": "p = torch.ones(8).pin_memory()",
    "empty_cache_inside": "torch.cuda.empty_cache()",
    # accepted: device-side work, pinned non-blocking copies, CPU scalars
    "device_factories": ("a = torch.full((8,), 2.0, device='cuda')\n    b = torch.arange(8, device='cuda')\n"
                         "    c = torch.randn(8, device='cuda')\n    d = torch.zeros(8, device='cuda')\n"
                         "    e = torch.empty(8, device='cuda')"),
    "cpu_scalar_operand": "y = x * torch.tensor(2.0)",
    "python_scalar_operand": "y = x * 2.0",
    "pinned_non_blocking_to_cuda": "y = pinned.to('cuda', non_blocking=True)",
    "pinned_blocking_to_cuda": "y = pinned.to('cuda')",
    "pinned_copy_into_device": "out.copy_(pinned, non_blocking=True)",
    "device_to_pinned_non_blocking": "pinned.copy_(x, non_blocking=True)",
    "capture_status": "assert torch.cuda.is_current_stream_capturing()",
}

_OUTSIDE = {
    "pin_memory_outside": ("p = torch.ones(8).pin_memory()\nassert p.is_pinned() and not torch.ones(8).is_pinned()\n"
                           "q = torch.empty(8, pin_memory=True)\nassert q.is_pinned() and q[2:].is_pinned()\n"
                           "y = p.to('cuda', non_blocking=True)\nassert not torch.cuda.is_current_stream_capturing()\n"),
    "replayed_pinned_copy": ("pinned = torch.zeros(8).pin_memory()\ns = torch.cuda.Stream()\n"
                             "with torch.cuda.graph(g):\n    y = pinned.to('cuda', non_blocking=True) * 2\n"
                             "pinned.fill_(3.0)\ng.replay()\ntorch.cuda.synchronize()\n"
                             "assert y.sum().item() == 48.0, y.sum().item()\n"),
    "error_leaves_capture": ("try:\n    with torch.cuda.graph(g):\n        y = host.to('cuda')\nexcept RuntimeError:\n"
                             "    pass\nassert not torch.cuda.is_current_stream_capturing()\nz = x * 2\n"
                             "assert z.sum().item() == 56.0\n"),
}


def rule_programs() -> list[Program]:
    """One program per rule (named ``rule_<name>``), in a fixed order."""
    programs = []
    for name, body in RULES.items():
        pinned = "pinned = torch.ones(8).pin_memory()\n" if "pinned" in body else ""
        source = _SETUP + pinned + "with torch.cuda.graph(g):\n    " + body + "\n"
        programs.append(Program(name=f"rule_{name}", kind="rule", source=source))
    for name, text in _OUTSIDE.items():
        programs.append(Program(name=f"rule_{name}", kind="rule", source=_SETUP + text))
    return programs
