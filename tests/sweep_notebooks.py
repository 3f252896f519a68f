"""Tiny notebooks for sweep tests: each run is logged, some points fail or stall on purpose."""

import time
from pathlib import Path

import nbformat


def tiny_notebook(path: Path, *, fail_at: int | None = 2, stall_at: int | None = None,
                  stall_once: bool = True, declare: str = "") -> Path:
    """A notebook that appends one line per execution to ``<path>.runs`` and saves a result.

    ``fail_at``: BATCH_SIZE whose point raises. ``stall_at``: BATCH_SIZE whose point writes
    ``<path>.stalled`` (the kernel's pid and its parent's) and sleeps two minutes, only the first
    time when ``stall_once``. ``declare``: more lines for the parameters cell. Every point
    shows a pyplot figure and records the backend.
    """
    runs, stalled = path.with_suffix(".runs"), path.with_suffix(".stalled")
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('BATCH_SIZE = 1\nDRAFT_TOKENS = 4\nOUTPUT_DIR = "results"\n' + declare)
    params.metadata["tags"] = ["parameters"]
    stall = "" if stall_at is None else (
        f"if BATCH_SIZE == {stall_at} and not ({stall_once} and os.path.exists({str(stalled)!r})):\n"
        f"    open({str(stalled)!r}, 'w').write(f'{{os.getpid()}} {{os.getppid()}}')\n"
        "    time.sleep(120)\n")
    nb.cells = [
        params,
        nbformat.v4.new_code_cell(
            "import os, time\n"
            f"with open({str(runs)!r}, 'a') as f:\n"
            "    f.write(f'{BATCH_SIZE}\\n')\n" + stall),
        nbformat.v4.new_code_cell(
            f"assert BATCH_SIZE != {fail_at}, 'batch size {fail_at} is broken on purpose'"
            if fail_at is not None else "pass"),
        nbformat.v4.new_code_cell(
            "import matplotlib\nimport matplotlib.pyplot as plt\nBACKEND = matplotlib.get_backend()\n"
            "plt.plot([0, BATCH_SIZE])\nplt.show()"),
        nbformat.v4.new_code_cell(
            "from graphborrow.run import results\n"
            "results.save('tiny', {'bytes': BATCH_SIZE * DRAFT_TOKENS * 1024, 'backend': BACKEND},"
            " OUTPUT_DIR, device_work=BATCH_SIZE)"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def executions(path: Path) -> list[int]:
    """BATCH_SIZE of every execution of the notebook at ``path`` so far, in order."""
    runs = path.with_suffix(".runs")
    return [int(line) for line in runs.read_text().split()] if runs.exists() else []


def wait_for(condition, timeout=120.0, what="condition"):
    """Poll ``condition`` until it holds; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
