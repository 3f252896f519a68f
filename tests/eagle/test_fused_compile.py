"""The fused kernels compile for an H200 (sm_90) without a GPU.

Triton's interpreter (test_fused_verify.py) runs the kernels' logic on CPU but never
compiles them; code that runs there can still fail to compile for CUDA. This drives
``scripts/compile_kernels.py`` in a fresh process (no interpreter), which compiles every
kernel variant a verification step and the standalone renorm launch, with Triton's
bundled ptxas, and checks none spills registers to local memory.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"verify_kernel", "token_prob_kernel", "init_kernel", "pass_kernel", "gather_kernel", "resolve_kernel",
           "kept_kernel", "apply_kernel"}

# (triton itself is imported only in the subprocess: importing it here, before
# graphborrow.eagle.triton.runtime selects the interpreter, would break the interpreted tests)
assert importlib.util.find_spec("triton") is not None, "install triton (the 'kernels' extra)"


@pytest.mark.slow
@pytest.mark.deep  # what make compile-kernels does
def test_every_kernel_variant_compiles_for_sm90_without_spills(tmp_path):
    out = tmp_path / "compiled.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compiled = json.loads(out.read_text())
    assert {row["kernel"] for row in compiled} == KERNELS
    spilling = [row for row in compiled if row.get("local_bytes", 0) > 0]
    assert not spilling, f"kernels spill registers to local memory: {spilling}"
    assert all(row.get("registers") for row in compiled), "cuobjdump reported no register counts"
