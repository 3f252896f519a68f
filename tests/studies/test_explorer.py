import matplotlib
import pytest

matplotlib.use("Agg")

from graphborrow.core.errors import ParameterError
from graphborrow.studies import explorer

pytestmark = pytest.mark.slow


def texts(fig):
    """Every title-like text of the figure: its suptitle (the verdict) and its subfigures' texts."""
    found = [t.get_text() for sub in fig.subfigs for t in sub.texts]
    return found + ([fig._suptitle.get_text()] if fig._suptitle is not None else [])


def test_explore_places_the_step_inside_free_runs():
    r = explorer.explore(batch_size=4, draft_tokens=2)
    assert r.runs and r.segments
    assert r.plan.fits and r.fits and r.needed_bytes > 0
    for address, nbytes in r.borrowed:
        assert any(a <= address and address + nbytes <= a + n for a, n in r.runs), hex(address)
    assert sum(n for _, n in r.borrowed) <= r.needed_bytes  # requested bytes at the peak, blocks rounded up
    assert len(r.table) == len(explorer.LADDERS[r.settings.ladder]) * len(explorer.DRAFT_CHOICES)
    cells = {(row["batch_size"], row["draft_tokens"]): row for row in r.table}
    assert cells[(4, 2)]["fits"] and cells[(4, 2)]["bytes"] == r.needed_bytes
    assert cells[(32, 16)]["bytes"] > cells[(1, 1)]["bytes"]


def test_too_large_a_step_does_not_fit_and_says_why():
    r = explorer.explore(batch_size=32, draft_tokens=16, vocab=128256)
    assert not r.fits and not r.plan.fits
    assert sum(n for _, n in r.borrowed) < r.needed_bytes, "what it held when it ran out is less than its peak"
    assert "does not fit" in r.status and "[512, 128256] float32 matrix" in r.status and "large" in r.status
    fig = explorer.render_result(r)
    assert any("does NOT fit" in t for t in texts(fig))


def test_lean_mode_needs_less_than_standard():
    standard = explorer.explore(batch_size=16, draft_tokens=8, mode="standard")
    lean = explorer.explore(batch_size=16, draft_tokens=8, mode="lean")
    assert lean.needed_bytes < standard.needed_bytes


def test_the_fit_policy_changes_the_grid_of_the_demo_pool():
    best = explorer.explore(pool="fit-policy demo", fit_policy="best", batch_size=16, draft_tokens=8)
    first = explorer.explore(pool="fit-policy demo", fit_policy="first", batch_size=16, draft_tokens=8)
    flipped = [(b["batch_size"], b["draft_tokens"]) for b, f in zip(best.table, first.table) if b["fits"] != f["fits"]]
    assert flipped and all(b["fits"] >= f["fits"] for b, f in zip(best.table, first.table))
    assert best.fits and not first.fits  # the chosen step itself ran under best fit only
    assert "20.0 MiB segment" in first.status


def test_settings_reject_bad_values():
    with pytest.raises(ParameterError, match="batch_size=64 is outside the captured ladder 1..32"):
        explorer.ExplorerSettings(batch_size=64)
    with pytest.raises(ParameterError, match="mode"):
        explorer.ExplorerSettings(mode="fast")
    with pytest.raises(ParameterError, match="pool"):
        explorer.ExplorerSettings(pool="elsewhere")


def test_explorer_controls_redraw_the_figure_and_the_status():
    ex = explorer.Explorer()
    first_png = bytes(ex.image.value)
    first_title = texts(ex.figure)
    assert first_png.startswith(b"\x89PNG")
    ex.controls["batch_size"].value = 32
    assert ex.result.settings.batch_size == 32
    assert texts(ex.figure) != first_title
    assert bytes(ex.image.value) != first_png
    ex.controls["ladder"].value = "8, 4, 2, 1"
    assert ex.controls["batch_size"].max == 8
    assert ex.result.settings.batch_size == 8
    ex.controls["mode"].value = "lean"
    assert "lean" in " ".join(texts(ex.figure))
    ex.controls["vocab"].value = 128256
    ex.controls["draft_tokens"].value = 16
    assert "does not fit" in ex.status.value and "segment" in ex.status.value


def test_the_teaching_start_is_the_pool_every_notebook_captures():
    """07 starts where the course's preset is: the same model, ladder and prefill give the same pool
    (block for block) as notebook.capture_ladder at the teaching preset."""
    from graphborrow.device import get_backend
    from graphborrow.studies import notebook, presets

    start = explorer.preset_settings("teaching")
    teaching = presets.PRESETS["teaching"]
    assert (start.vocab, start.prefill_tokens, start.batch_size, start.draft_tokens, start.layers) == (
        teaching["VOCAB"], teaching["PREFILL_TOKENS"], teaching["BATCH_SIZE"], teaching["DRAFT_TOKENS"],
        teaching["LAYERS"])
    setup = presets.resolve("teaching", "sim", layout_only=True)
    backend = get_backend("sim", backed=False, activate=False)
    with backend.activated():
        segments = notebook.capture_ladder(setup, device=backend).snapshot()

    def layout(segs):
        return sorted((s["total_size"], tuple((b["size"], b["state"]) for b in s["blocks"])) for s in segs)

    assert layout(explorer.explore(start).segments) == layout(segments)
    backend.close()
