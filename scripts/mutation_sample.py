"""Name a deterministic sample of mutmut's mutants, for a mutation run that must fit a time box.

    python scripts/mutation_sample.py 'graphborrow.core.borrow.*=2' 'graphborrow.core.arena.*=6' ...

Each argument is a mutant-name pattern (fnmatch, as ``mutmut run`` takes them) and a stride
k: of every function's mutants it keeps numbers 1, 1+k, 1+2k, ... (so every function keeps at
least one). Mutants that already have a result are left out unless ``--rerun``. Prints the
names, one a line, for ``mutmut run $(python scripts/mutation_sample.py ...)``; run it after
``mutmut run`` has generated ``mutants/`` (``mutmut results --all true`` lists them).
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"^(?P<function>.+)__mutmut_(?P<number>\d+)$")


def all_mutants() -> dict[str, str]:
    """Every generated mutant's name and its status (``not checked`` until it ran)."""
    exe = Path(sys.executable).with_name("mutmut")
    out = subprocess.run([str(exe), "results", "--all", "true"], cwd=REPO, capture_output=True, text=True, check=True)
    statuses = {}
    for line in out.stdout.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            statuses[name] = status
    return statuses


def sample(statuses: dict[str, str], strides: dict[str, int], rerun: bool = False) -> list[str]:
    """Names matching a pattern whose number is 1 modulo that pattern's stride.

    Args:
        statuses: mutant name -> status, as :func:`all_mutants` returns.
        strides: pattern -> k (keep every k-th mutant of each function, starting at the first).
        rerun: also name mutants that already have a result.

    Returns:
        The sampled names, sorted.
    """
    chosen = []
    for name, status in statuses.items():
        match = _NAME.match(name)
        if not match or (status != "not checked" and not rerun):
            continue
        stride = next((k for pattern, k in strides.items() if fnmatch.fnmatch(name, pattern)), None)
        if stride is not None and (int(match["number"]) - 1) % stride == 0:
            chosen.append(name)
    return sorted(chosen)


def _stride(text: str) -> tuple[str, int]:
    pattern, sep, k = text.rpartition("=")
    if not sep or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write PATTERN=K with K a whole number >= 1, e.g. 'graphborrow.core.arena.*=4'")
    return pattern, int(k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("strides", nargs="+", type=_stride, help="PATTERN=K, e.g. 'graphborrow.core.borrow.*=2'")
    parser.add_argument("--rerun", action="store_true", help="also name mutants that already have a result")
    args = parser.parse_args()
    names = sample(all_mutants(), dict(args.strides), rerun=args.rerun)
    if not names:
        raise SystemExit("no mutant matches: run `mutmut run` once so mutants/ exists, and check the patterns")
    print("\n".join(names))


if __name__ == "__main__":
    main()
