"""``python -m graphborrow simulate``: an unmodified GPU script on the simulated device."""

import pickle
import subprocess
import sys
import textwrap

import pytest

from graphborrow.core.errors import ParameterError
from graphborrow.run.simulate import parse_bytes, simulate_source

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    x = torch.randn(64, 128, device="cuda")
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    (x @ x.T).softmax(-1)  # warm-up: cuBLAS makes its handle here; inside a capture that fails, as on CUDA
    pool = torch.cuda.graph_pool_handle()
    graphs = []  # kept alive: a pool whose graphs are all gone cannot be captured into again
    for n in (256, 64):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = (x @ torch.randn(128, n, device="cuda")).softmax(-1)
        graphs.append((g, y))
    print("ran with", sys.argv[1:])
""")


def test_a_script_runs_unmodified_and_its_graph_pool_is_reported(tmp_path):
    sim = simulate_source(SCRIPT, name="tiny", out=tmp_path, batches=(1, 4), draft_tokens=(4,), vocab=32000)
    assert sim.error is None
    snapshot = pickle.loads(sim.snapshot_path.read_bytes())
    assert snapshot["device_traces"][0] and {"segments", "allocator_settings"} <= set(snapshot)
    [report] = sim.reports
    pool = report.pool(report.planned_pool)
    assert report.planned_pool != (0, 0) and pool.reserved_bytes >= 2 * 2**20 and pool.largest_run > 0
    assert {r["batch_size"] for r in report.fit} == {1, 4}
    assert "memory_viz" in sim.summary() and "verification steps against pool" in sim.summary()


def test_the_command_line_passes_arguments_and_reports_the_scripts_error(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys, torch\nprint('args', sys.argv[1:])\nraise ValueError('own failure')\n")
    done = subprocess.run([sys.executable, "-m", "graphborrow", "simulate", "--out", str(tmp_path), str(script), "a",
                           "--flag"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "args ['a', '--flag']" in done.stdout
    assert "ValueError: own failure" in done.stdout


def test_sizes_are_read_with_units_and_bad_ones_named():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("512MiB") == 2**29 and parse_bytes("1000") == 1000
    with pytest.raises(ParameterError, match="not a memory size"):
        parse_bytes("lots")


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphborrow", "simulate", *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def blocks(snapshot) -> list[int]:
    return sorted(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")


def test_os_exit_ends_the_run_with_its_status_after_the_snapshot_is_written(tmp_path):
    script = tmp_path / "quits.py"
    script.write_text("import os, torch\nx = torch.empty(3 * 2**20, device='cuda')\nos._exit(0)\n"
                      "print('after exit')\n")
    done = cli("--out", tmp_path / "out", script)
    assert done.returncode == 0, done.stderr
    assert "after exit" not in done.stdout and "memory_viz" in done.stdout
    snapshot = pickle.loads((tmp_path / "out" / "quits_snapshot.pickle").read_bytes())
    assert 12 * 2**20 in blocks(snapshot)  # the tensor alive at the os._exit call


def test_os_exit_from_python_stops_the_script_there_and_keeps_its_status(tmp_path):
    sim = simulate_source("import os, torch\nx = torch.empty(2**20, device='cuda')\nos._exit(3)\n"
                          "y = torch.empty(2**21, device='cuda')\n", name="quits", out=tmp_path)
    assert sim.exit_status == 3 == sim.status and sim.error == "os._exit(3)"
    assert blocks(sim.snapshot) == [4 * 2**20] and sim.snapshot_path.is_file()


def test_a_sigterm_the_script_gets_ends_it_there_with_status_143_and_the_snapshot(tmp_path):
    """It had ended the run with no snapshot, no summary and no message."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    sim = simulate_source("import os, signal, torch\nx = torch.empty(2**20, device='cuda')\n"
                          "os.kill(os.getpid(), signal.SIGTERM)\ny = torch.empty(2**21, device='cuda')\n",
                          name="killed", out=tmp_path)
    assert sim.status == 143 and sim.error == "terminated by SIGTERM"
    assert blocks(sim.snapshot) == [4 * 2**20] and sim.snapshot_path.is_file()
    assert signal.getsignal(signal.SIGTERM) is before  # the runner's own handler is back


def test_a_sigterm_on_the_command_line_prints_the_summary_and_exits_143(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, torch\nx = torch.empty(3 * 2**20, device='cuda')\n"
                      "os.kill(os.getpid(), signal.SIGTERM)\nprint('after the signal')\n")
    done = cli("--out", tmp_path / "out", script)
    assert done.returncode == 143, done.stderr
    assert "after the signal" not in done.stdout and "memory_viz" in done.stdout
    assert (tmp_path / "out" / "killed_snapshot.pickle").is_file()


def test_sys_exit_status_is_the_runs_status(tmp_path):
    assert simulate_source("import sys\nsys.exit(4)\n", out=tmp_path).status == 4
    assert simulate_source("import sys\nsys.exit()\n", out=tmp_path).status == 0


def test_a_relative_out_is_resolved_before_the_script_changes_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    sim = simulate_source("import os, torch\nos.chdir('elsewhere')\nx = torch.empty(8, device='cuda')\n",
                          name="moves", out="snapshots")
    assert sim.error is None and sim.snapshot_path == tmp_path / "snapshots" / "moves_snapshot.pickle"
    assert sim.snapshot_path.is_file() and not (tmp_path / "elsewhere" / "snapshots").exists()


def test_the_allocator_reads_its_settings_at_the_first_cuda_call_as_torch_does(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    before = simulate_source("import os, torch\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"
                             "x = torch.empty(2**20, device='cuda')\n", out=tmp_path)
    assert before.snapshot["allocator_settings"]["expandable_segments"] is True
    [segment] = before.snapshot["segments"]
    assert segment["is_expandable"]
    after = simulate_source("import os, torch\nx = torch.empty(2**20, device='cuda')\n"
                            "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"
                            "y = torch.empty(2**20, device='cuda')\n", out=tmp_path)
    assert after.snapshot["allocator_settings"]["expandable_segments"] is False  # read once, at the first use


def test_threads_the_script_starts_see_the_device_and_are_waited_for(tmp_path):
    sim = simulate_source(textwrap.dedent("""
        import threading, time, torch
        kept = []
        def work():
            time.sleep(0.2)
            kept.append(torch.empty(5 * 2**20 // 4, device="cuda"))
        threading.Thread(target=work).start()
    """), out=tmp_path)
    assert sim.error is None
    assert 5 * 2**20 in blocks(sim.snapshot)  # made after the script's last line, before the snapshot


def test_deepcopy_of_a_module_on_the_device_allocates_its_copy(tmp_path):
    sim = simulate_source(textwrap.dedent("""
        import copy, torch
        model = torch.nn.Linear(256, 256, device="cuda")
        twin = copy.deepcopy(model)
        assert twin.weight.data_ptr() != model.weight.data_ptr() and twin.weight.is_cuda
    """), out=tmp_path)
    assert sim.error is None
    assert blocks(sim.snapshot).count(256 * 256 * 4) == 2


def test_torch_compile_is_refused_at_the_call_by_name(tmp_path):
    sim = simulate_source("import torch\nf = torch.compile(lambda x: x * 2)\n", out=tmp_path)
    assert sim.error.startswith("NotImplementedError: torch.compile has no answer on the simulated device")
    assert "torch.cuda.graph" in sim.error


@pytest.mark.parametrize("capacity, problem", [
    ("0.5", "not a whole number of bytes"), ("inf", "not a whole number"), ("nan", "not a whole number"),
    (str(2**64), "at most 2**63 bytes"), ("0", "positive"), ("-1GiB", "positive"), ("lots", "not a memory size"),
])
def test_bad_capacities_are_usage_errors_before_the_run(tmp_path, capacity, problem):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    done = cli(f"--capacity={capacity}", "--out", tmp_path, script)
    assert done.returncode == 2 and "ran" not in done.stdout
    assert problem in done.stderr and "Traceback" not in done.stderr


def test_an_unusable_out_is_a_usage_error_before_the_run(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    occupied = tmp_path / "a_file"
    occupied.write_text("")
    for out, problem in ((occupied, "is a file"), (occupied / "below", "cannot be made")):
        done = cli("--out", out, script)
        assert done.returncode == 2 and "ran" not in done.stdout, done.stderr
        assert problem in done.stderr and "Traceback" not in done.stderr


# a program whose run depends on the device's own answers: its memory, its multiprocessors
DEVICE_DEPENDENT = textwrap.dedent("""
    import torch
    props = torch.cuda.get_device_properties(0)
    torch.cuda.set_per_process_memory_fraction(0.5)
    kept = [torch.empty(props.total_memory // 5, dtype=torch.uint8, device="cuda") for _ in range(2)]
    try:
        kept.append(torch.empty(props.total_memory // 5, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        kept.append(torch.empty(props.multi_processor_count * 2**20, dtype=torch.uint8, device="cuda"))
    free, total = torch.cuda.mem_get_info()
    kept.append(torch.empty((total - free) // 2**30, device="cuda"))
""")


def _segments(segments) -> list[tuple]:
    return [(s["address"], s["total_size"], tuple(s["segment_pool_id"]),
             tuple((b["size"], b["state"]) for b in s["blocks"])) for s in segments]


TRACED = ("segment_alloc", "alloc", "free_completed", "segment_free")


def _trace(snapshot) -> list[tuple]:
    return [(e["action"], e["addr"], e["size"]) for e in snapshot["device_traces"][0] if e["action"] in TRACED]


@pytest.mark.parametrize("name", ["model_llama-tiny-cpu-built", "device-dependent"])
def test_the_library_api_and_the_command_line_are_one_device(name, tmp_path):
    """The same program through a SimBackend answering torch.cuda (what graphborrow.fidelity runs the
    H200 corpus on) and through ``simulate``: identical snapshots; and the H200's graph pools."""
    from graphborrow.fidelity.compare import compare_snapshots
    from graphborrow.fidelity.fuzz.corpus import program_of, read_corpus
    from graphborrow.fidelity.fuzz.generate import Program
    from graphborrow.fidelity.fuzz.run import simulate_program

    recorded = next((r for r in read_corpus(["model"]) if r["name"] == name), None)
    program = program_of(recorded) if recorded else Program(name=name, kind="probe", seed=0, settings="",
                                                             source=DEVICE_DEPENDENT)
    library = simulate_program(program)
    command_line = simulate_source(program.source, out=tmp_path).snapshot
    assert _segments(library["segments"]) == _segments(command_line["segments"])
    library_trace = [tuple(row[:3]) for row in library["trace"] if row[0] in TRACED]
    assert library_trace and library_trace == _trace(command_line)
    if recorded:  # and both are the H200's
        graph_pools = [[s for s in segments if tuple(s["segment_pool_id"]) != (0, 0)]
                       for segments in (recorded["segments"], command_line["segments"])]
        assert compare_snapshots(*graph_pools).identical
