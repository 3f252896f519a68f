"""The sweep's plot: made from a results column, and a log line saying why when it is not."""

from graphborrow.run.sweep import _plot
from graphborrow.run.sweep.points import PointResult


def points(results):
    return [PointResult(point_id=f"p{i}", params={"SEED": i}, status="ok", results=r) for i, r in enumerate(results)]


def test_a_plot_column_no_point_has_is_logged_with_every_column_there_is(tmp_path):
    said = []
    made = _plot(tmp_path / "sweep.png", points([{"results.value": 1.0}, {"results.value": 2.0}]), ["SEED"],
                 "nosuch", said.append)
    assert made is None and not (tmp_path / "sweep.png").exists()
    assert said == ["no plot: no point has a column 'nosuch' (--plot-y / plot_y); its columns are SEED, results.value"]


def test_without_a_numeric_result_the_log_says_to_name_a_column(tmp_path):
    said = []
    assert _plot(tmp_path / "sweep.png", points([{"results.name": "a"}, {"results.name": "b"}]), ["SEED"], None,
                 said.append) is None
    assert said == ["no plot: the points saved no numeric results.* value (save_results); name a column to plot "
                    "with --plot-y"]


def test_the_first_numeric_result_is_plotted_against_the_first_axis(tmp_path):
    said = []
    made = _plot(tmp_path / "sweep.png", points([{"results.value": 1.0}, {"results.value": 3.0}]), ["SEED"], None,
                 said.append)
    assert made == tmp_path / "sweep.png" and made.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and said == []
