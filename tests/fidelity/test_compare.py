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

from graphborrow.fidelity.compare import (
    ADDRESS_ORDER,
    BLOCK_LAYOUT,
    IMPORT_SIDE_EFFECT,
    KNOCK_ON,
    align_traces,
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
from graphborrow.studies.model_pools import (
    README_BEGIN,
    README_END,
    markdown_table,
    recorded_rows,
    replace_between_markers,
    simulate_recording,
)

pytestmark = pytest.mark.slow

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]


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


def test_two_pools_without_blocks_have_no_agreement_to_report():
    """Nothing compared is no figure: two empty pools are identical, their agreement undefined; one
    empty side against blocks is agreement 0."""
    empty = compare_snapshots([], [])
    assert (empty.agreement_blocks, empty.agreement_bytes, empty.compared, empty.identical) == (None, None, False, True)
    assert "agreement n/a, nothing to compare" in empty.summary()
    assert (empty.row()["agreement (blocks)"], empty.row()["agreement (bytes)"]) == (None, None)
    one_side = compare_snapshots([_seg(0, [(2 * MiB, "inactive")], "small")], [])
    assert (one_side.agreement_blocks, one_side.agreement_bytes, one_side.identical) == (0.0, 0.0, False)
    assert "agreement 0.0000" in one_side.summary()


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


def _made(address, size, owner_size, stream=1):
    return [{"action": "segment_alloc", "addr": address, "size": size, "stream": stream},
            {"action": "alloc", "addr": address, "size": owner_size, "stream": stream}]


def test_segments_pair_by_the_cudamalloc_that_made_them():
    first = [(4 * MiB, "active_allocated"), (16 * MiB, "inactive")]
    second = [(8 * MiB, "active_allocated"), (12 * MiB, "inactive")]
    extra = [(2 * MiB, "active_allocated"), (18 * MiB, "inactive")]
    ref = [_seg(0x2000000, first), _seg(0x1000000, second)]
    ref_trace = _made(0x2000000, 20 * MiB, 4 * MiB) + _made(0x1000000, 20 * MiB, 8 * MiB)
    # the candidate makes one more segment of that size, first, and places all of them elsewhere
    cand = [_seg(0x9000000, extra), _seg(0x5000000, first), _seg(0x7000000, second)]
    cand_trace = (_made(0x9000000, 20 * MiB, 2 * MiB) + _made(0x5000000, 20 * MiB, 4 * MiB)
                  + _made(0x7000000, 20 * MiB, 8 * MiB))
    result = compare_snapshots(ref, cand, ref_trace, cand_trace)
    assert result.segments == (2, 3, 2)
    assert result.blocks == (4, 6, 4)  # both of the reference's segments found their twin
    assert [d.candidate for d in result.differences if d.where == "segment on one side only"] == [
        "large segment of 20971520 B with 2 blocks"]
    # by kind and size alone (no traces), allocation order pairs the extra segment with the first
    assert compare_snapshots(ref, cand).blocks[2] < 4
    alignment = align_traces(ref_trace, cand_trace)
    assert alignment.matched == {0: 2, 1: 3, 2: 4, 3: 5} and alignment.counts == (4, 6, 4)


def test_equal_segments_with_swapped_layouts_name_the_address_order():
    a = [(4 * MiB, "active_allocated"), (16 * MiB, "inactive")]
    b = [(20 * MiB, "inactive")]
    ref = [_seg(0x1000000, a), _seg(0x3000000, b)]
    swapped = [_seg(0x1000000, b), _seg(0x3000000, a)]
    result = compare_snapshots(ref, swapped)
    assert result.agreement_blocks == 0.0 and set(result.causes()) == {ADDRESS_ORDER}
    other = [_seg(0x1000000, [(8 * MiB, "active_allocated"), (12 * MiB, "inactive")]), _seg(0x3000000, b)]
    assert set(compare_snapshots(ref, other).causes()) == {BLOCK_LAYOUT}


def test_an_import_side_effect_and_the_segment_it_moves_are_named():
    site = "kaldi.py:22:<module> < __init__.py:1:<module> < __init__.py:8:<module>"
    norm = "modeling_llama.py:59:__init__"
    ref_trace = ([{"action": "segment_alloc", "addr": 0x1000000, "size": 2 * MiB, "stream": 0, "site": site},
                  {"action": "alloc", "addr": 0x1000000, "size": 4, "stream": 0, "site": site}]
                 + [dict(e, stream=0, site=norm) for e in _made(0x3000000, 20 * MiB, 8 * MiB)]
                 + [{"action": "alloc", "addr": 0x1000200, "size": 8192, "stream": 0, "site": "linear.py:1:__init__"}])
    cand_trace = ([dict(e, stream=0, site=norm) for e in _made(0x5000000, 20 * MiB, 8 * MiB)]
                  + [{"action": "segment_alloc", "addr": 0x7000000, "size": 2 * MiB, "stream": 0, "site": ""},
                     {"action": "alloc", "addr": 0x7000000, "size": 8192, "stream": 0, "site": "linear.py:1:__init__"}])
    result = compare_snapshots([], [], ref_trace, cand_trace)
    assert result.causes() == {IMPORT_SIDE_EFFECT: 2, KNOCK_ON: 1}, result.summary()
    # the same candidate segment with nothing before it to explain it stays unexplained
    alone = compare_snapshots([], [], ref_trace[2:], cand_trace)
    assert [c.split(":")[0] for c in alone.causes()] == ["unexplained"]


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
    # no machine paths in what the script writes: outside the repository only the names remain
    assert str(tmp_path) not in (out / "summary.json").read_text()
    assert summary["workloads"][0]["file"] == "mistral-7b.json.gz" and " --out pools " in summary["command"] + " "
    rec = load_recording(out / "mistral-7b.json.gz")
    assert rec["params"]["decode_batches"] == [4, 1] and rec["source"]["command"].startswith("python benchmarks/")
    assert str(tmp_path) not in json.dumps(rec)
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


def test_the_script_writes_paths_inside_the_repository_relative_to_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import model_pools
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert model_pools.portable(ROOT / "data" / "models_h200" / "x.json.gz") == "data/models_h200/x.json.gz"
    assert model_pools.portable("/somewhere/else/pools") == "pools"
    assert model_pools.command_line(["--out", str(ROOT / "data" / "models_h200"), "--layers", "2"]) == (
        "python benchmarks/model_pools.py --out data/models_h200 --layers 2")
    assert model_pools.command_line([f"--out={ROOT}/data/x"]) == "python benchmarks/model_pools.py --out=data/x"
    summary = json.loads((ROOT / "data" / "models_h200" / "summary.json").read_text())
    assert summary["command"] == "python benchmarks/model_pools.py --out data/models_h200"
    assert all(w["file"] == f"data/models_h200/{w['workload']}.json.gz" for w in summary["workloads"])


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
