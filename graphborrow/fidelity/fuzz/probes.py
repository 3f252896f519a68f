"""One operation at many shapes: what its CUDA kernel allocates while it runs.

Sorting, top-k, scans, reductions, index accumulation, random permutations and
data-dependent selections call library code (CUB, multi-block radix select, global
reductions) that allocates temporaries through the caching allocator, sized by rules
ATen's source does not state. Each probe program makes its input on one line, runs the
operation on the next and deletes both on a third, over a grid of sizes and dtypes, so
the allocator trace of one H200 run gives, per line, exactly what the operation took.
"""

from __future__ import annotations

import itertools

from .generate import Program

__all__ = ["probe_programs"]

_HEADER = "import torch\n\ntorch.manual_seed(0)\nwith torch.inference_mode():\n"
_LENGTHS = (1, 100, 1000, 2048, 4096, 4097, 6000, 8192, 16384, 32000, 65536, 128256, 262144, 1_000_000)
_ROWS = (1, 4, 32, 128)


def _lines(setup: str, op: str) -> list[str]:
    return [f"    x = {setup}", f"    r = {op}", "    del r, x"]


def _sorts() -> list[str]:
    out = []
    for n, b, dtype in itertools.product(_LENGTHS, _ROWS, ("float32", "bfloat16", "int64")):
        if n * b > 8_000_000:
            continue
        setup = (f"torch.randint(0, 1000, ({b}, {n}), device='cuda')" if dtype == "int64"
                 else f"torch.randn({b}, {n}, device='cuda', dtype=torch.{dtype})")
        out += _lines(setup, "torch.sort(x, dim=-1, descending=True)")
        out += _lines(setup, "torch.argsort(x, dim=-1, stable=True)")
        for k in (1, 8, 50, 1024):
            if k <= n:
                out += _lines(setup, f"torch.topk(x, {k}, dim=-1)")
    for n in (1000, 4096, 100_000):  # sorting along a dim that is not the last
        out += _lines(f"torch.randn({n}, 16, device='cuda')", "torch.sort(x, dim=0)")
    return out


def _scans_and_reductions() -> list[str]:
    out = []
    for n, b in itertools.product(_LENGTHS, (1, 8, 64)):
        if n * b > 8_000_000:
            continue
        for dtype in ("float32", "bfloat16", "int64", "bool", "int32"):
            setup = {"int64": f"torch.randint(0, 9, ({b}, {n}), device='cuda')",
                     "int32": f"torch.randint(0, 9, ({b}, {n}), device='cuda', dtype=torch.int32)",
                     "bool": f"torch.rand({b}, {n}, device='cuda') > 0.5"}.get(
                dtype, f"torch.randn({b}, {n}, device='cuda', dtype=torch.{dtype})")
            out += _lines(setup, "x.cumsum(-1)")
            if b > 1:
                out += _lines(setup, "x.cumsum(0)")
            if dtype in ("float32", "bfloat16"):
                for op in ("x.sum()", "x.sum(-1)", "x.sum(0)", "x.float().mean()", "x.amax(-1)", "x.argmax()",
                           "x.argmax(-1)", "torch.linalg.vector_norm(x)", "x.max()", "x.var(-1)"):
                    out += _lines(setup, op)
            if dtype == "bool":
                out += _lines(setup, "x.any()") + _lines(setup, "x.all(-1)") + _lines(setup, "x.sum()")
    return out


def _indexing() -> list[str]:
    out = []
    for n, rows, width in itertools.product((16, 1000, 65536), (1, 100, 10_000), (1, 128, 4096)):
        if n * width > 16_000_000 or rows * width > 16_000_000:
            continue
        setup = f"torch.zeros({n}, {width}, device='cuda')"
        idx = f"torch.randint(0, {n}, ({rows},), device='cuda')"
        out += [f"    i = {idx}", f"    v = torch.ones({rows}, {width}, device='cuda')"]
        out += _lines(setup, "x.index_put_((i,), v, accumulate=True)")
        out += _lines(setup, "x.index_put_((i,), v, accumulate=False)")
        out += _lines(setup, "x.index_add_(0, i, v)")
        out += _lines(setup, "x[i]")
        out += ["    del i, v"]
    for n in (10, 1000, 4096, 65536, 1_000_000):
        out += _lines(f"torch.arange({n}, device='cuda')", f"torch.randperm({n}, device='cuda')")
        out += _lines(f"torch.arange({n}, device='cuda')", "(x % 3 == 0).nonzero()")
        out += _lines(f"torch.arange({n}, device='cuda')", "x.masked_select(x % 3 == 0)")
        out += _lines(f"torch.arange({n}, device='cuda')", "torch.unique(x % 97)")
        out += _lines(f"torch.rand(4, {n}, device='cuda')", "torch.multinomial(x, 1)")
    return out


def _norms_and_misc() -> list[str]:
    out = []
    for rows, h, dtype in itertools.product((1, 8, 512, 4096), (64, 4096, 5120), ("float32", "bfloat16", "float16")):
        setup = f"torch.randn({rows}, {h}, device='cuda', dtype=torch.{dtype})"
        out += [f"    w = torch.ones({h}, device='cuda', dtype=torch.{dtype})"]
        out += _lines(setup, f"torch.nn.functional.layer_norm(x, ({h},), w, w)")
        out += _lines(setup, f"torch.nn.functional.rms_norm(x, ({h},), w, eps=1e-6)")
        out += _lines(setup, "torch.nn.functional.softmax(x, -1)")
        out += _lines(setup, "x.float().softmax(-1).to(x.dtype)")
        out += _lines(setup, "torch.where(x > 0, x, 0.0)")
        out += _lines(setup, "x[:, None] * 2")
        out += ["    del w"]
    return out


def probe_programs() -> list[Program]:
    """The probe programs (``probe_sort``, ``probe_scan``, ``probe_index``, ``probe_norm``)."""
    groups = {"sort": _sorts(), "scan": _scans_and_reductions(), "index": _indexing(), "norm": _norms_and_misc()}
    return [Program(name=f"probe_{name}", kind="probe", source=_HEADER + "\n".join(lines) + "\n")
            for name, lines in groups.items()]
