"""The simulated device against the H200: every recorded model pool, block for block.

``benchmarks/model_pools.py`` writes one recording per workload into ``data/models_h200/``
(pool snapshot, allocator trace with Python sites, attention backend, cuBLAS workspace).
Each is rebuilt here on a layout-only simulated device with the recording's parameters
and compared. A difference must have a named cause, and the pool must agree block for
block unless ``known_differences.json`` there lists the cause with the reason it is not
modelled (so a new kind of difference fails CI until someone models or explains it).

Until the GPU run has produced recordings this module collects no tests (nothing is
skipped); tests/test_compare.py covers the machinery meanwhile.
"""

import json
from pathlib import Path

import pytest

from graphborrow.compare import compare_recordings, load_recording
from graphborrow.pool_study import simulate_recording

DATA = Path(__file__).resolve().parents[1] / "data" / "models_h200"
RECORDINGS = sorted(DATA.glob("*.json.gz"))
KNOWN = json.loads((DATA / "known_differences.json").read_text()) if (DATA / "known_differences.json").exists() else {}

if RECORDINGS:

    @pytest.mark.parametrize("path", RECORDINGS, ids=[p.name.split(".json")[0] for p in RECORDINGS])
    def test_simulated_pool_agrees_with_the_gpu(path):
        gpu = load_recording(path)
        result = compare_recordings(gpu, simulate_recording(gpu))
        causes = result.causes()
        unexplained = [c for c in causes if c.startswith("unexplained")]
        assert not unexplained, f"differences without a cause:\n{result.summary()}"
        accepted = KNOWN.get(gpu["workload"], {})
        unaccepted = [c for c in causes if not any(c.startswith(k) for k in accepted)]
        if unaccepted or result.agreement_blocks < 1.0:
            assert not unaccepted and accepted, (
                f"{gpu['workload']}: the simulated pool differs from the GPU's "
                f"(agreement {result.agreement_blocks:.4f} blocks, {result.agreement_bytes:.4f} bytes):\n"
                f"{result.summary()}\nmodel these causes in graphborrow/sim, or list them with the reason in "
                f"{DATA / 'known_differences.json'}"
            )
