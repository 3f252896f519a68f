"""The README is short, every Python snippet in it runs, and every page it links to exists."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


def test_the_readme_is_short_and_links_only_to_pages_that_exist():
    assert len(README.splitlines()) <= 150, "the README stays at most 150 lines: move detail to docs/"
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"the README links to {target}, which does not exist"


def test_the_layout_table_has_one_row_per_layer():
    from tests.test_layers import LAYERS

    rows = re.findall(r"^\| `([a-z]+)` \|", README.split("## Layout", 1)[1], re.M)
    assert rows == LAYERS


@pytest.mark.slow
def test_every_python_snippet_runs(tmp_path):
    """The snippets run one after another in one fresh interpreter, from the repository's root
    (they read data/), on the simulated device: what a reader pasting them would see."""
    blocks = _blocks("python")
    assert len(blocks) >= 2, "the README shows the library from Python"
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n\n".join(blocks))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fits" in proc.stdout or "largest batch" in proc.stdout, proc.stdout[-2000:]


def test_every_command_in_the_readme_exists():
    """Each `make` target the README names is in the Makefile; each subcommand answers --help."""
    commands = [line.strip() for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    commands += re.findall(r"`(python -m graphborrow [a-z-]+)[^`]*`", README)
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    for target in re.findall(r"`make ([a-z-]+)`", README) + [c.split()[1] for c in commands if c.startswith("make ")]:
        assert target in targets, f"the README names make {target}, which the Makefile lacks"
    for command in commands:
        if command.startswith("python -m graphborrow"):
            sub = command.split()[3]
            proc = subprocess.run([sys.executable, "-m", "graphborrow", sub, "--help"], capture_output=True, text=True)
            assert proc.returncode == 0, f"{command}: {proc.stderr[-500:]}"


def test_the_fused_steps_ratio_is_the_records():
    """The README's 'replayed from a graph ... x one softmax(x / T)' range is the H200 record's, at its
    baseline (softmax of the logits over the temperature, as notebook 05's table shows it)."""
    from graphborrow.studies import measured

    table = measured.fused_kernel_table(measured.load("verify_kernels_h200"))
    ratios = [r["vs_softmax_t"] for r in table]
    low, high = re.search(r"\*\*([\d.]+)–([\d.]+)× one `softmax\(x / T\)`\*\*", README).groups()
    assert (low, high) == (f"{min(ratios):.2f}", f"{max(ratios):.2f}"), (low, high, min(ratios), max(ratios))
