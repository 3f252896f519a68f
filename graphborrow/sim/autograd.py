"""Autograd through CUDA kernels the simulated device models as a whole.

Most ops reach the simulated device below autograd (``__torch_dispatch__``), so autograd
records them, saves what their derivative formula saves and runs their backward ops on the
device: nothing here is needed for them. A few CUDA kernels are modelled as a whole at the
Python level, because the CPU build reaches them differently (``scaled_dot_product_attention``
picks a CUDA backend; ``_fused_rms_norm`` is a CUDA kernel but a CPU composite): with autograd
recording, such a model runs as the forward of a :class:`KernelFunction`, which keeps what the
CUDA kernel's derivative keeps (its input, its auxiliary outputs) until the backward, and whose
backward allocates what the CUDA backward kernel allocates. On a backed device the gradients'
values come from the CPU: torch's autograd of a CPU reference of the forward.
"""

from __future__ import annotations

import torch

from .torch_function import torch_functions_off

__all__ = ["KernelFunction", "records_grad", "reference_grads"]


def records_grad(*tensors) -> bool:
    """Whether autograd records an op on these tensors (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


class KernelFunction(torch.autograd.Function):
    """``KernelFunction.apply(rule, *inputs)``: the CUDA model ``rule`` as an autograd node.

    ``rule.forward(*inputs)`` returns ``(outputs, saved, state)``: the kernel's outputs (a tuple,
    the first ``rule.differentiable`` of them get gradients), the tensors its derivative keeps and
    anything else the backward needs; ``rule.backward(state, grads, saved, needs)`` returns one
    gradient (or None) per input. Gradients of outputs nobody used stay None (never zeros the
    CUDA backward would not allocate).
    """

    @staticmethod
    def forward(ctx, rule, *inputs):
        ctx.set_materialize_grads(False)
        outputs, saved, state = rule.forward(*inputs)
        ctx.rule, ctx.state = rule, state
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*outputs[rule.differentiable:])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[1:]
        return (None,) + tuple(ctx.rule.backward(ctx.state, grads, ctx.saved_tensors, needs))


def reference_grads(function, inputs, grads, needs) -> tuple:
    """Gradients of ``function`` at the plain CPU tensors ``inputs`` for the output gradients ``grads``
    (None for an output without one): the values a backward writes on a backed device, one per
    input ``needs`` asks for, in order."""
    with torch_functions_off():
        plain = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip(inputs, needs)]
        with torch.enable_grad():
            outs = function(*plain)
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wanted = [p for p in plain if p is not None and p.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    return tuple(g for g in found)
