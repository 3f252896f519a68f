"""The eager serving call's short path: ``eagle_verify(..., validate=False)`` in as few Python
operations as its checks allow.

A serving engine calls verification eagerly, once per step, after its target model's
graph replays; at small batches the call's host time is what the user waits for. Once a
step's plan is compiled and its workspace made for the current stream (:mod:`.fused`, by
the plan's first call), :func:`short_path` checks the arguments directly (no
:class:`~graphborrow.eagle.step.VerifyStep`), takes the outputs from the caller (``out=``)
or one allocation, and launches the compiled kernel through a
:class:`~graphborrow.eagle.triton.direct.KernelLaunch` whose other arguments were packed
once per plan and stream (Triton's C launcher where the direct module does not apply).
Anything else returns None and takes the general path, which checks again and names any
problem.

Once :func:`short_path` (that check and launch, in Python) has launched a plan on a stream,
:func:`eager` makes the same call in C++ first: a route to the plan's launches goes to
:data:`ROUTES`' compiled :mod:`.eager_call` router, which reads the tensors' attributes
without Python and declines (returns None) wherever :func:`short_path` would not take the
call the same way. :func:`short_path` is what the router mirrors, and what runs where it
cannot be built.
"""

from __future__ import annotations

import torch

from ..modes import VerifyResult
from ..step import draw_into
from ..validate import LOGIT_DTYPES
from . import eager_call
from .direct import kernel_launch
from .fused import INT32_MAX, ON_CLEAR, STEP_PLANS, CachedWorkspace, StepPlan, launch_tails, tunables
from .launch import ALIGN, bound_call, capturing_now, current_stream, direct_disabled, launch_hooks
from .step_kernel import ABSENT, NUMBER, ONE_VALUE, PER_REQUEST

__all__ = ["EAGER_CALL_ARGS", "ROUTES", "Routes", "eager", "short_path"]

_TENSOR = torch.Tensor
_I64, _I32, _F32 = torch.int64, torch.int32, torch.float32
EAGER_CALL_ARGS = 18  # per-call kernel arguments: 13 addresses, 3 parameters, 2 thresholds (:func:`.fused._step_args`)


def eager(logits, candidates, tree, temperatures, top_ks=None, top_ps=None, coins=None, coins_final=None,
          generator=None, threshold_single=1.0, threshold_acc=1.0, out=None):
    """:func:`~graphborrow.eagle.eagle_verify` with ``validate=False``, no borrow and CUDA
    logits: through :data:`ROUTES`' compiled router where it has a route for the call, else
    :func:`short_path`; None when the call is not that common case (the general path then
    checks it)."""
    if ROUTES.router is not None:
        result = ROUTES.router.call(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final,
                                    generator, threshold_single, threshold_acc, out)
        if result is not None:
            return result
    return short_path(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                      threshold_single, threshold_acc, out)


def short_path(logits, candidates, tree, temperatures, top_ks=None, top_ps=None, coins=None, coins_final=None,
               generator=None, threshold_single=1.0, threshold_acc=1.0, out=None):
    """:func:`eager` in Python: the call checked and launched, and its route added for the
    compiled router; None when the call is not the common case.

    The common case: plain tensors of the documented shapes and dtypes, contiguous (what
    :meth:`~graphborrow.eagle.step.VerifyStep.check` and ``require_contiguous`` ask); coins
    given on the logits' device or not given; temperature, top-k and top-p numbers or
    tensors on that device the kernel reads in place; the plan compiled and its workspace
    made for the current stream (by an earlier call); ``out`` not given, or three int32
    tensors of the outputs' shapes, contiguous, on that device; every pointer 16-byte
    aligned; no launch hook installed and no graph being captured. It launches the kernel
    the general path launches, with the same arguments (:func:`.fused._step_args`).

    Returns:
        A :class:`~graphborrow.eagle.modes.VerifyResult`, or None.
    """
    if candidates is None:
        candidates = getattr(tree, "candidates", None)
    try:
        index, next_token, next_sibling, depth = (tree.retrive_index, tree.retrive_next_token,
                                                  tree.retrive_next_sibling, tree.tree_depth)
    except AttributeError:
        return None
    T = _TENSOR
    if not (type(logits) is T and type(candidates) is T and type(index) is T and type(next_token) is T
            and type(next_sibling) is T and type(depth) is int and depth >= 1):
        return None
    shape = candidates.shape
    if len(shape) != 2:
        return None
    bs, d = shape
    lshape = logits.shape
    if not (bs and d and len(lshape) == 2 and lshape[0] == bs * d and lshape[1] and index.shape == shape
            and next_token.shape == shape and next_sibling.shape == shape and candidates.dtype is _I64
            and index.dtype is _I64 and next_token.dtype is _I64 and next_sibling.dtype is _I64
            and logits.dtype in LOGIT_DTYPES and logits.is_contiguous() and candidates.is_contiguous()
            and index.is_contiguous() and next_token.is_contiguous() and next_sibling.is_contiguous()):
        return None
    device = logits.get_device()
    if coins is not None and not (type(coins) is T and coins.shape == shape and coins.dtype is _F32
                                  and coins.is_contiguous() and coins.get_device() == device):
        return None
    if coins_final is not None and not (type(coins_final) is T and coins_final.shape == (bs,)
                                        and coins_final.dtype is _F32 and coins_final.is_contiguous()
                                        and coins_final.get_device() == device):
        return None
    ts, ta = threshold_single, threshold_acc
    if not ((type(ts) is float or type(ts) is int) and (type(ta) is float or type(ta) is int)
            and 0.0 <= ts <= 1.0 and 0.0 <= ta <= 1.0):
        return None
    kind = type(temperatures)
    if kind is float or kind is int:
        forms, in_place, dtypes, t_value, t_tensor = (NUMBER,), (False,), (), float(temperatures), None
    elif kind is T and _readable(temperatures, bs, device):
        forms, in_place, dtypes, t_value, t_tensor = ((PER_REQUEST if temperatures.numel() == bs else ONE_VALUE,),
                                                      (True,), (temperatures.dtype,), 0.0, temperatures)
    else:
        return None
    k_value, k_tensor, p_value, p_tensor = 0, None, 0.0, None
    if top_ks is None:
        forms, in_place = forms + (ABSENT,), in_place + (False,)
    else:
        kind = type(top_ks)
        if kind is int or (kind is float and top_ks.is_integer()):
            forms, in_place, k_value = forms + (NUMBER,), in_place + (False,), min(int(top_ks), INT32_MAX)
        elif kind is T and _readable(top_ks, bs, device) and not top_ks.is_floating_point():
            forms = forms + (PER_REQUEST if top_ks.numel() == bs else ONE_VALUE,)
            in_place, dtypes, k_tensor = in_place + (True,), dtypes + (top_ks.dtype,), top_ks
        else:
            return None
    if top_ps is None:
        forms, in_place = forms + (ABSENT,), in_place + (False,)
    else:
        kind = type(top_ps)
        if kind is float or kind is int:
            forms, in_place, p_value = forms + (NUMBER,), in_place + (False,), float(top_ps)
        elif kind is T and _readable(top_ps, bs, device):
            forms = forms + (PER_REQUEST if top_ps.numel() == bs else ONE_VALUE,)
            in_place, dtypes, p_tensor = in_place + (True,), dtypes + (top_ps.dtype,), top_ps
        else:
            return None
    plan = STEP_PLANS.plans.get((bs, d, lshape[1], logits.dtype, depth, device, forms, in_place, dtypes, tunables()))
    if plan is None or not plan.launcher.ready or launch_hooks() or capturing_now():
        return None
    entry = plan.cached.get(current_stream(device))
    if entry is None:
        return None
    w = entry.pointers
    pointers = (logits.data_ptr(), candidates.data_ptr(), index.data_ptr(), next_token.data_ptr(),
                next_sibling.data_ptr(), w.coins if coins is None else coins.data_ptr(),
                w.coins_final if coins_final is None else coins_final.data_ptr(),
                w.temps if t_tensor is None else t_tensor.data_ptr(),
                w.top_k if k_tensor is None else k_tensor.data_ptr(),
                w.top_p if p_tensor is None else p_tensor.data_ptr())
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9 = pointers
    if (p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7 | p8 | p9) % ALIGN:  # (aligned(*pointers), written out)
        return None
    if entry.launches is None:
        _direct_launches(plan, entry, device)
    ROUTES.add(plan, entry, logits, depth, forms, dtypes)
    if out is None:
        buffer = plan.output_template.new_empty(plan.output_words)
        o0 = buffer.data_ptr()
        at_index, at_length = plan.output_bytes
        o1, o2 = o0 + at_index, o0 + at_length
    else:
        out = _callers_outputs(out, plan, device)
        if out is None:
            return None
        out, (o0, o1, o2) = out
    if coins is None:
        draw_into(entry.views.coins, generator)
    if coins_final is None:
        draw_into(entry.views.coins_final, generator)
    call = (p0, p1, p2, p3, p4, o0, o1, o2, p5, p6, p7, p8, p9, t_value, k_value, p_value, float(ts),
            max(float(ta), 1e-9))
    for launch, head, tail in entry.launches:
        launch(*head, *call, *tail)
    return plan.outputs(buffer) if out is None else out


class Routes:
    """The compiled short path's :class:`Router` (:mod:`.eager_call`), made on the first
    launch here and emptied with the plans (``fused.clear_plans``); ``router`` stays None
    where the module cannot be built or ``GRAPHBORROW_DIRECT_LAUNCH=0``."""

    def __init__(self):
        self.router, self.tried = None, False

    def add(self, plan: StepPlan, entry: CachedWorkspace, logits: torch.Tensor, depth: int, forms: tuple,
            dtypes: tuple) -> None:
        """Route later calls of ``plan``'s key on the current stream to ``entry``'s launches."""
        if not self.tried and not direct_disabled():
            self.tried = True
            compiled = eager_call.module()
            if compiled is not None:
                self.router = compiled.Router(tunables, launch_hooks, draw_into, VerifyResult)
                ON_CLEAR.append(self.router.clear)
        if self.router is None or direct_disabled():
            return
        w, device = entry.pointers, plan.device
        self.router.add(plan.bs, plan.d, plan.vocab, depth, device, logits.dtype, forms,
                        (*dtypes, None, None, None)[:3], eager_call.module().current_stream(device),
                        (w.coins, w.coins_final, w.temps, w.top_k, w.top_p), entry.views.coins,
                        entry.views.coins_final, plan.steps, plan.output_words, plan.output_starts[1],
                        plan.output_starts[2], entry.launches, tunables(), (plan, entry))


ROUTES = Routes()


def _callers_outputs(out, plan: StepPlan, device: int):
    """``(out as a VerifyResult, its three addresses)`` when ``out`` is three int32 tensors of
    the step's output shapes, contiguous, 16-byte aligned, on ``device``; else None (the
    general path names the problem)."""
    try:
        predicts, accept_index, accept_length = out
    except (TypeError, ValueError):
        return None
    T, bs = _TENSOR, plan.bs
    if not (type(predicts) is T and type(accept_index) is T and type(accept_length) is T
            and predicts.dtype is _I32 and accept_index.dtype is _I32 and accept_length.dtype is _I32
            and predicts.shape == (bs * plan.d,) and accept_index.shape == (bs, plan.steps)
            and accept_length.shape == (bs,) and predicts.is_contiguous() and accept_index.is_contiguous()
            and accept_length.is_contiguous() and predicts.get_device() == device
            and accept_index.get_device() == device and accept_length.get_device() == device):
        return None
    pointers = predicts.data_ptr(), accept_index.data_ptr(), accept_length.data_ptr()
    if (pointers[0] | pointers[1] | pointers[2]) % ALIGN:
        return None
    return out if type(out) is VerifyResult else VerifyResult(predicts, accept_index, accept_length), pointers


def _readable(value: torch.Tensor, bs: int, device: int) -> bool:
    """A per-request tensor the kernel reads in place: on the logits' device, contiguous, one
    value per request or a single value (0-d)."""
    return (value.get_device() == device and value.is_contiguous()
            and (value.numel() == bs or value.dim() == 0))


def _direct_launches(plan: StepPlan, entry: CachedWorkspace, device: int) -> None:
    """The direct launches for ``entry``'s stream, ``(call, leading, trailing)`` each, launched
    as ``call(*leading, *per_call_arguments, *trailing)``: a
    :class:`~graphborrow.eagle.triton.direct.KernelLaunch` holding everything but the per-call
    arguments where the direct module applies, else the compiled kernel's C launcher with grid,
    stream and handles before the kernel arguments, the workspace's and plan's after."""
    stream = current_stream(device)
    if plan.output_template is None:
        plan.output_template = torch.empty(0, dtype=torch.int32, device=plan.torch_device)
    launches = []
    for kernel, programs, tail in zip(plan.launcher.compiled, plan.programs, launch_tails(plan, entry.pointers)):
        packed = None
        if not direct_disabled():
            packed = kernel_launch(kernel, device, (programs, 1, 1), stream, EAGER_CALL_ARGS, tail)
        if packed is not None:
            launches.append((packed.launch, (), ()))
        else:
            launch, leading = bound_call(kernel)
            launches.append((launch, (programs, 1, 1, stream, *leading), tail))
    entry.launches = launches
