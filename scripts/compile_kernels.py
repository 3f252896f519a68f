"""Compile every fused verification kernel for an H200 (sm_90) on a machine without a GPU.

    TRITON_INTERPRET=0 python scripts/compile_kernels.py [--json out.json]

Triton ships ptxas, so its compiler runs without a device: this drives the host code of
graphborrow.eagle.triton.fused / fused_renorm with CPU tensors in place of CUDA ones, turning
every kernel launch into a compile-only warmup (a stand-in driver reports an sm_90 target),
so each variant the step uses is compiled with the argument types it really gets. It
catches what the interpreter cannot (code that does not compile for CUDA) and reports
registers and spills per kernel. Nothing is launched and no numbers are produced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("compile_kernels.py compiles for CUDA: run it with TRITON_INTERPRET=0")
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as driver_config  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CompileOnlyDriver:
    """What the JIT asks of a driver before it compiles; nothing here can launch."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def resource_usage(cubin: bytes) -> dict:
    """Registers and local-memory (spill) bytes per thread, from the bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", text, re.S)
    return {"registers": int(found.group(1)), "local_bytes": int(found.group(2))} if found else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    driver_config.set_active(CompileOnlyDriver(args.arch))
    compiled = []
    original_run = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        kernel = original_run(self, *a, grid=grid, warmup=True, **kw)
        compiled.append({"kernel": self.fn.__name__, **resource_usage(kernel.asm["cubin"]),
                         "shared": kernel.metadata.shared, "warps": kernel.metadata.num_warps})
        return kernel

    JITFunction.run = compile_only
    from graphborrow.eagle.draft_tree import build_draft_tree
    from graphborrow.eagle.step import VerifyStep
    from graphborrow.eagle.triton import fused as fv
    from graphborrow.eagle.triton import fused_renorm
    from graphborrow.eagle.triton.runtime import INTERPRETED
    from graphborrow.eagle.triton.timeline import run_traced, traced_config

    assert not INTERPRETED
    started = time.monotonic()
    bs, d, vocab = 4, 8, 128256
    tree = build_draft_tree(4, 3, d, bs, vocab, generator=torch.Generator().manual_seed(0))
    per_request = dict(temperatures=torch.full((bs,), 0.7), top_ks=torch.full((bs,), 50), top_ps=torch.full((bs,), 0.9))
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(bs * d, vocab, dtype=dtype)
        coins, final = torch.zeros(bs, d), torch.zeros(bs)
        for renorm in ({}, {"top_ks": 50}, {"top_ps": 0.9}, {"top_ks": 50, "top_ps": 0.9}, per_request):
            if dtype != torch.float32 and renorm:
                continue
            params = {"temperatures": 1.0, **renorm}
            step = VerifyStep(logits, tree.candidates, tree, params["temperatures"], params.get("top_ks"),
                              params.get("top_ps"), coins, final).check()
            fv.run_step(step, fv.allocate_outputs(step))  # every launch a compile-only warmup
    one = build_draft_tree(4, 3, d, 1, vocab, generator=torch.Generator().manual_seed(1))  # one request: one launch
    step = VerifyStep(torch.zeros(d, vocab), one.candidates, one, 1.0, 50, 0.9, torch.zeros(1, d), torch.zeros(1)).check()
    fv.run_step(step, fv.allocate_outputs(step))
    plain = VerifyStep(torch.zeros(bs * d, vocab), tree.candidates, tree, 1.0, None, None, coins, final).check()
    run_traced(traced_config(plain), plain)  # the step that records its clock times
    fv.fused_token_probs(torch.zeros(bs * d, vocab), 1.0, d, torch.zeros(bs * d, 4, dtype=torch.int64))
    probs = torch.zeros(32, vocab)
    fused_renorm.top_p_renorm(probs, 0.9, validate=False)
    fused_renorm.top_k_renorm(probs, 50, validate=False)
    for row in compiled:
        print(f"{row['kernel']:<22} registers {row.get('registers')!s:>4} local bytes {row.get('local_bytes')!s:>5} "
              f"shared {row['shared']:>6} warps {row['warps']}")
    print(f"{len(compiled)} launches compiled in {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(compiled, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
