import matplotlib
import pytest

matplotlib.use("Agg")

from graphborrow import widgets
from graphborrow.errors import ParameterError

pytest.importorskip("graphborrow.eagle")


def texts(fig):
    return [t.get_text() for sub in fig.subfigs for t in sub.texts]


def test_explore_places_temporaries_inside_free_runs():
    r = widgets.explore(batch_size=4, draft_tokens=2)
    assert r.runs and r.segments
    assert r.needed_bytes > 0 and r.fits
    for address, nbytes in r.borrowed:
        assert any(a <= address and address + nbytes <= a + n for a, n in r.runs), hex(address)
    assert len(r.table) == len(widgets.LADDERS[r.settings.ladder]) * len(widgets.DRAFT_CHOICES)
    fits = {(row["batch_size"], row["draft_tokens"]): row["fits"] for row in r.table}
    assert fits[(4, 2)] is True
    # more rows can never need fewer bytes
    by_cell = {(row["batch_size"], row["draft_tokens"]): row["bytes"] for row in r.table}
    assert by_cell[(32, 16)] > by_cell[(1, 1)]


def test_too_large_a_step_does_not_fit_and_says_so():
    r = widgets.explore(batch_size=32, draft_tokens=16, vocab=128256)
    assert not r.fits and r.borrowed is None
    fig = widgets.render_result(r)
    assert any("does NOT fit" in t for t in texts(fig))


def test_lean_mode_needs_less_than_standard():
    standard = widgets.explore(batch_size=16, draft_tokens=8, mode="standard")
    lean = widgets.explore(batch_size=16, draft_tokens=8, mode="lean")
    assert lean.needed_bytes < standard.needed_bytes


def test_settings_reject_bad_values():
    with pytest.raises(ParameterError, match="batch_size=64 is outside the captured ladder 1..32"):
        widgets.ExplorerSettings(batch_size=64)
    with pytest.raises(ParameterError, match="mode"):
        widgets.ExplorerSettings(mode="fast")


def test_explorer_controls_redraw_the_figure():
    ex = widgets.Explorer()
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
