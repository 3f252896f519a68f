"""Block-for-block pool comparison and the causes it names.

The simulated device is compared with itself under one changed fact (a workspace size,
the attention backend), so the expected difference, and its cause, is known.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from graphborrow.compare import (
    canonical_segments,
    classify,
    compact_trace,
    compare_recordings,
    compare_snapshots,
    expand_trace,
    load_recording,
    recording,
    save_recording,
)
from graphborrow.pool_study import (
    README_BEGIN,
    README_END,
    markdown_table,
    recorded_rows,
    replace_between_markers,
    simulate_recording,
)

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def _seg(address, blocks, kind="large"):
    return {"address": address, "total_size": sum(s for s, _ in blocks), "segment_type": kind,
            "blocks": [{"size": s, "state": st} for s, st in blocks]}


def test_addresses_do_not_matter_but_blocks_do():
    a = [_seg(0x1000000, [(4 * MiB, "active_allocated"), (16 * MiB, "inactive")]), _seg(0x9000000, [(2 * MiB, "inactive")], "small")]
    b = [_seg(0x7000000, [(4 * MiB, "active_allocated"), (16 * MiB, "inactive")]), _seg(0x2000000, [(2 * MiB, "inactive")], "small")]
    same = compare_snapshots(a, b, [{"action": "segment_alloc", "addr": 0x1000000}, {"action": "segment_alloc", "addr": 0x9000000}],
                             [{"action": "segment_alloc", "addr": 0x7000000}, {"action": "segment_alloc", "addr": 0x2000000}])
    assert same.segments == (2, 2, 2) and same.agreement_blocks == 1.0 and same.agreement_bytes == 1.0
    split = copy.deepcopy(b)
    split[0]["blocks"] = [{"size": 4 * MiB, "state": "active_allocated"}, {"size": 8 * MiB, "state": "active_allocated"},
                          {"size": 8 * MiB, "state": "inactive"}]
    diff = compare_snapshots(a, split)
    assert diff.blocks == (3, 4, 2) and diff.agreement_blocks == 0.5
    assert diff.bytes[2] == 4 * MiB + 2 * MiB
    assert len(diff.differences) == 3  # the 16 MiB block on one side, the 8 + 8 MiB on the other
    assert not diff.identical


def test_a_segment_on_one_side_only_is_a_difference():
    a = [_seg(0, [(20 * MiB, "inactive")]), _seg(1 << 30, [(2 * MiB, "inactive")], "small")]
    b = [_seg(0, [(20 * MiB, "inactive")])]
    result = compare_snapshots(a, b)
    assert result.segments == (2, 1, 1)
    assert [d.reference for d in result.differences] == ["small segment of 2097152 B with 1 blocks"]


def test_allocation_order_comes_from_the_trace():
    segs = [_seg(0x5000000, [(2 * MiB, "inactive")], "small"), _seg(0x1000000, [(20 * MiB, "inactive")])]
    by_address = canonical_segments(segs)
    by_trace = canonical_segments(segs, [{"action": "segment_alloc", "addr": 0x5000000},
                                         {"action": "segment_alloc", "addr": 0x1000000}])
    assert [s.total_size for s in by_address] == [20 * MiB, 2 * MiB]
    assert [s.total_size for s in by_trace] == [2 * MiB, 20 * MiB]


def test_trace_compaction_round_trip_keeps_sites():
    frames = [{"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
              {"filename": "/x/transformers/integrations/sdpa_attention.py", "line": 96, "name": "sdpa_attention_forward"},
              {"filename": "/x/transformers/models/llama/modeling_llama.py", "line": 270, "name": "forward"}]
    entries = [{"action": "alloc", "addr": 10, "size": 512, "stream": 7, "frames": frames},
               {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
               {"action": "free_completed", "addr": 10, "size": 512, "stream": 7}]
    rows, sites = compact_trace(entries)
    assert len(rows) == 2 and sites == ["sdpa_attention.py:96:sdpa_attention_forward < modeling_llama.py:270:forward"]
    back = expand_trace(rows, sites)
    assert back[0]["site"] == sites[0] and back[1]["site"] == "" and back[0]["stream"] == 7


def test_causes_are_named_from_sites_and_sizes():
    ctx = {"never_freed": True, "workspace_sizes": {32 * MiB}, "in_pool": True, "neighbour_site": ""}
    ws = {"action": "alloc", "size": 32 * MiB, "site": "modeling_llama.py:10:forward"}
    assert classify(ws, ctx).startswith("cuBLAS")
    attn = {"action": "alloc", "size": 4096, "site": "sdpa_attention.py:96:sdpa_attention_forward"}
    assert classify(attn, dict(ctx, never_freed=False)).startswith("attention kernel")
    moe = {"action": "alloc", "size": 512, "site": "moe.py:400:grouped_mm_experts_forward"}
    assert classify(moe, dict(ctx, never_freed=False)).startswith("mixture-of-experts")
    rng = {"action": "alloc", "size": 8, "site": "graphs.py:80:capture_begin"}
    assert classify(rng, ctx).startswith("RNG state")
    warm = {"action": "alloc", "size": 4096, "site": "model_pools.py:1:run"}
    assert classify(warm, dict(ctx, in_pool=False, never_freed=False)).startswith("warm-up")
    odd = {"action": "alloc", "size": 4096, "site": "x.py:1:f"}
    assert classify(odd, dict(ctx, never_freed=False)).startswith("unexplained: alloc of 4096 bytes at x.py:1:f")


SMALL = {"decode_batches": [4, 1], "layers": 1, "context": 64, "draft_tokens": 4}


def test_same_workload_twice_is_identical():
    rec = {"model": "llama-3-8b", "params": SMALL}
    result = compare_recordings(simulate_recording(rec), simulate_recording(rec))
    assert result.identical, result.summary()
    assert result.trace_events[0] == result.trace_events[2] > 100


def test_a_missing_workspace_is_found_and_named():
    rec = {"model": "llama-3-8b", "params": SMALL}
    with_ws = simulate_recording(dict(rec, blas_workspace_bytes=32 * MiB))
    without = simulate_recording(dict(rec, blas_workspace_bytes=4 * MiB))
    result = compare_recordings(with_ws, without)
    causes = result.causes()
    assert any(c.startswith("cuBLAS") for c in causes), result.summary()
    assert not any(c.startswith("unexplained") for c in causes), result.summary()


def test_another_attention_backend_is_found_and_named():
    rec = {"model": "llama-3-8b", "params": SMALL}
    cudnn = simulate_recording(dict(rec, sdpa_choices=[{"backend": "cudnn"}]))
    math = simulate_recording(dict(rec, sdpa_choices=[{"backend": "math"}]))
    result = compare_recordings(cudnn, math)
    assert not result.identical
    # math materialises the attention scores: the events differ, none without a cause
    assert result.trace_events[0] != result.trace_events[1]
    assert not any(c.startswith("unexplained") for c in result.causes()), result.summary()


def test_recordings_survive_a_file(tmp_path):
    rec = simulate_recording({"model": "mixtral-8x7b", "params": SMALL})
    path = save_recording(rec, tmp_path / "r.json.gz")
    back = load_recording(path)
    assert back["params"] == SMALL
    assert compare_recordings(rec, back).identical
    (tmp_path / "bad.json").write_text(json.dumps({"trace": []}))
    with pytest.raises(ValueError, match="no 'segments'"):
        load_recording(tmp_path / "bad.json")


def test_recording_strips_frames():
    rec = recording([{"address": 0, "total_size": 512, "frames": [{"x": 1}], "segment_pool_id": (0, 1),
                      "blocks": [{"size": 512, "state": "inactive", "frames": [{"y": 2}]}]}], None, model="m")
    assert rec["segments"][0]["frames"] == [] and rec["segments"][0]["blocks"][0]["frames"] == []
    assert "trace" not in rec and rec["model"] == "m"


def test_gpu_script_dry_run_on_the_simulated_device(tmp_path):
    out = tmp_path / "pools"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_pools.py"), "--device", "sim", "--out", str(out),
         "--workloads", "mistral-7b", "--layers", "1", "--batches", "4,1", "--context", "64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == {} and [w["workload"] for w in summary["workloads"]] == ["mistral-7b"]
    rec = load_recording(out / "mistral-7b.json.gz")
    assert rec["params"]["decode_batches"] == [4, 1] and rec["source"]["command"].startswith("python benchmarks/")
    assert rec["study"]["pool"]["reserved_bytes"] == sum(s["total_size"] for s in rec["segments"])
    assert {c["backend"] for c in rec["sdpa_choices"]} == {"cudnn"} and "torch.bool" in rec["sdpa_choices"][0]["call"]
    assert compare_recordings(rec, simulate_recording(rec)).identical
    rows = recorded_rows(out)
    assert [r["workload"] for r in rows] == ["mistral-7b"] and rows[0]["reserved MiB"] > 0
    assert recorded_rows(tmp_path / "nothing here") is None
    table = markdown_table(summary, out)
    assert "| mistral-7b |" in table and "1.000 / 1.000" in table
    readme = f"before\n{README_BEGIN}\nold table\n{README_END}\nafter\n"
    updated = replace_between_markers(readme, table)
    assert "old table" not in updated and table in updated and updated.endswith(f"{README_END}\nafter\n")


def test_gpu_script_keeps_going_past_a_failing_workload(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_pools.py"), "--device", "sim", "--out", str(tmp_path),
         "--workloads", "mistral-7b,llama-3-8b", "--layers", "1", "--batches", "0", "--context", "64"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["errors"]) == {"mistral-7b", "llama-3-8b"}
    assert "decode_batches must be positive" in summary["errors"]["llama-3-8b"]
