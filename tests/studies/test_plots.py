import matplotlib
import pytest
from matplotlib.colors import to_hex

matplotlib.use("Agg")

from graphborrow.core.errors import SnapshotFormatError
from graphborrow.studies import plots

MiB = 2**20


def segment(address, blocks, pool=(0, 1)):
    """A torch-format segment built from (size, state) pairs."""
    out, offset = [], 0
    for size, state in blocks:
        out.append({"address": address + offset, "size": size, "requested_size": size,
                    "state": state, "frames": []})
        offset += size
    return {"device": 0, "address": address, "total_size": offset, "stream": 0,
            "segment_type": "large", "segment_pool_id": pool, "blocks": out}


SEGMENTS = [
    segment(0x7F0000400000, [(4 * MiB, "inactive"), (2 * MiB, "active_allocated"),
                             (2 * MiB, "inactive"), (2 * MiB, "inactive")]),
    segment(0x7F0000000000, [(1 * MiB, "active_pending_free"), (1 * MiB, "inactive")]),
    segment(0x7F0001000000, [(2 * MiB, "inactive")], pool=(0, 0)),
]


def patches(fig, prefix):
    return [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith(prefix)]


def test_memory_map_draws_every_block_coloured_by_state():
    fig = plots.memory_map(SEGMENTS, title="pool")
    blocks = patches(fig, "block:")
    assert len(blocks) == 7
    by_state = {}
    for p in blocks:
        by_state.setdefault(p.get_gid(), set()).add(to_hex(p.get_facecolor()))
    assert by_state["block:active_allocated"] == {plots.STATE_COLORS["active_allocated"]}
    assert by_state["block:active_pending_free"] == {plots.STATE_COLORS["active_pending_free"]}
    assert by_state["block:inactive"] == {plots.STATE_COLORS["inactive"]}
    assert fig.axes[0].get_title() == "pool"
    # rows are sorted by address: the lowest segment is row 0 with its pending block
    pending = patches(fig, "block:active_pending_free")[0]
    assert pending.get_y() == pytest.approx(-0.4)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0].startswith("0x7f0000000000")


def test_memory_map_outlines_runs_and_hatches_borrowed_blocks():
    runs = [(0x7F0000400000, 4 * MiB), (0x7F0000400000 + 6 * MiB, 4 * MiB), (0x1234, 10)]
    borrowed = [(0x7F0000400000, 1 * MiB)]
    fig = plots.memory_map(SEGMENTS, runs=runs, borrowed=borrowed)
    outlined = patches(fig, "run")
    assert len(outlined) == 2  # the run outside every segment is not drawn
    assert outlined[1].get_x() == pytest.approx(6.0)
    assert outlined[1].get_width() == pytest.approx(4.0)
    hatched = patches(fig, "borrowed")
    assert len(hatched) == 1 and hatched[0].get_hatch() == "///"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "free run" in legend and "borrowed" in legend


def test_memory_map_filters_by_pool_and_accepts_full_snapshot_dict():
    fig = plots.memory_map({"segments": SEGMENTS}, pool_id=(0, 0))
    assert len(patches(fig, "block:")) == 1


def test_memory_map_small_segments_use_kib():
    fig = plots.memory_map([segment(4096, [(512, "active_allocated"), (1536, "inactive")])])
    assert "KiB" in fig.axes[0].get_xlabel()


def test_memory_map_rejects_non_snapshots():
    with pytest.raises(SnapshotFormatError, match="segment 0 has no 'total_size'"):
        plots.memory_map([{"address": 0}])
    with pytest.raises(SnapshotFormatError, match="cover 1048576 bytes but total_size is 2097152"):  # the one reader checks
        plots.memory_map([{**segment(1 << 30, [(MiB, "inactive")]), "total_size": 2 * MiB}])
    with pytest.raises(SnapshotFormatError, match="segments"):
        plots.memory_map({"traces": []})


def test_capacity_map_hatches_cells_that_do_not_fit():
    table = [{"batch_size": b, "draft_tokens": d, "bytes": b * d * MiB, "fits": b * d <= 16}
             for b in (1, 4, 16) for d in (2, 4, 8)]
    fig = plots.capacity_map(table)
    ax = fig.axes[0]
    assert len(patches(fig, "fits")) == 5   # 1x2 1x4 1x8 4x2 4x4
    assert len(patches(fig, "no-fit")) == 4
    assert all(p.get_hatch() == "xx" for p in patches(fig, "no-fit"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "8"]
    assert "128" in [t.get_text() for t in ax.texts]  # 16 x 8 MiB
    with pytest.raises(KeyError, match="fits"):
        plots.capacity_map([{"batch_size": 1, "draft_tokens": 1, "bytes": 1}])


def test_bar_policy_comparison_one_bar_per_policy_and_metric():
    fig = plots.bar_policy_comparison(
        {"runs": {"total": 562.9, "largest": 224.0}, "whole_segments": {"total": 452.0, "largest": 224.0}})
    ax = fig.axes[0]
    bars = [p for p in ax.patches]
    assert len(bars) == 4
    assert [t.get_text() for t in ax.get_xticklabels()] == ["total", "largest"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"runs", "whole_segments"}
    assert max(b.get_height() for b in bars) == pytest.approx(562.9)


def test_sweep_plot_one_line_per_hue_skipping_failures():
    rows = [{"batch_size": str(b), "draft_tokens": str(d), "mib": str(b * d), "status": "ok"}
            for b in (1, 2, 4) for d in (4, 8)]
    rows.append({"batch_size": "8", "draft_tokens": "4", "mib": "", "status": "failed"})
    fig = plots.sweep_plot(rows, x="batch_size", y="mib", hue="draft_tokens")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2
    assert list(lines[0].get_xdata()) == [1, 2, 4]
    assert list(lines[1].get_ydata()) == [8, 16, 32]


def test_memory_map_marks_runs_that_can_never_hold_a_borrow():
    small = (0x7F0000000000 + 1 * MiB, 1 * MiB)  # under 2 MiB: not even a small-pool segment fits
    usable = (0x7F0000400000, 4 * MiB)
    fig = plots.memory_map(SEGMENTS, runs=[usable, small])
    assert [(p.get_x(), p.get_width()) for p in patches(fig, "run:unborrowable")] == [(1.0, 1.0)]
    assert len([p for p in fig.axes[0].patches if p.get_gid() == "run"]) == 1
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "free run too small to borrow" in labels


def test_largest_borrowable_plot_draws_the_size_classes():
    from graphborrow.planning.capacity import size_class_table

    rows = size_class_table([m * MiB for m in (1, 2, 3, 9, 10, 12, 19, 20, 21, 40)])
    fig = plots.largest_borrowable_plot(rows)
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "largest"]
    assert list(line.get_ydata()) == [0, 1, 1, 1, 10, 12, 18, 20, 20, 40]
    assert {p.get_gid() for p in fig.axes[0].patches} >= {"band:nothing", "band:small only"}


def test_many_policies_put_the_legend_beside_the_bars():
    """Eight workloads' bars: a legend inside the axes would hide some of them."""
    many = {f"workload {i}": {"runs": 100.0 + i, "whole segments": 50.0 + i} for i in range(8)}
    fig = plots.bar_policy_comparison(many)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend_box = ax.get_legend().get_window_extent()
    axes_box = ax.get_window_extent()
    assert legend_box.x0 >= axes_box.x1, "the legend must sit right of the axes, not over the bars"
    few = plots.bar_policy_comparison({"runs": 1.0, "whole_segments": 2.0})
    few.canvas.draw()
    assert few.axes[0].get_legend().get_window_extent().x1 <= few.axes[0].get_window_extent().x1
