"""Results files: written atomically, readable without torch, and checked by the guard."""

import json
import subprocess
import sys
import time

from graphborrow.run import results

GUARD = [sys.executable, "-m", "graphborrow", "check-results"]


def test_check_results_names_every_kind_of_problem(tmp_path):
    now = time.time()
    results.save("good", {"x": 1}, tmp_path, device_work=3)
    results.save("old", {"x": 1}, tmp_path, device_work=3)
    record = json.loads((tmp_path / "old.json").read_text())
    record["finished_at"] = now - 100
    (tmp_path / "old.json").write_text(json.dumps(record))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "lazy.json").write_text(json.dumps({"device_work": True, "finished_at": now + 1}))
    problems = results.check_results(["good", "old", "broken", "list", "lazy", "absent"], tmp_path, since=now - 10)
    text = "\n".join(problems)
    assert len(problems) == 5 and not any(p.startswith("good:") for p in problems)
    assert "old: " in text and "is stale" in text
    assert "broken: " in text and "not valid JSON" in text
    assert "list: " in text and "holds a list" in text
    assert "lazy: device_work=True" in text
    assert "absent: no results file" in text
    assert results.check_results(["good"], tmp_path, since=now - 10) == []


def test_saving_and_reading_results_do_not_import_torch(tmp_path):
    code = ("import sys\nfrom graphborrow.run import results\n"
            f"p = results.save('n', {{'a': [1, 2]}}, {str(tmp_path)!r}, device_work=1)\n"
            "assert results.load(p)['results'] == {'a': [1, 2]}\n"
            "assert 'torch' not in sys.modules, 'results pulled in torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["n.json"], "no temporary file is left behind"


def test_guard_command_fails_on_missing_results(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    (nbs / "01_x.ipynb").write_text("{}")
    proc = subprocess.run([*GUARD, "--notebooks", str(nbs)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "FAIL 01_x: no results file" in proc.stderr
    results.save("01_x", {"a": 1}, nbs / "results", device_work=1)
    proc = subprocess.run([*GUARD, "--notebooks", str(nbs)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "ok: 1 notebooks" in proc.stdout
