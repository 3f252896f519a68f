"""Write the mutation score of the last `mutmut run` to a JSON file under data/.

    python scripts/mutation_score.py data/mutation_capacity.json [MUTANT_PATTERN ...]

With patterns (fnmatch over mutant names, e.g. 'graphborrow.capacity.*'), only the mutants
they match are counted: [tool.mutmut] also lists the rule modules that `make mutation` scores.

Reads `mutmut results --all true` (run from the checkout that holds `mutants/`) and records
the counts by status, the score (killed and timed out over all mutants that tests reach),
every surviving mutant's name, and the command, mutmut and torch versions.
"""

from __future__ import annotations

import collections
import fnmatch
import json
import subprocess
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 1:
        print(__doc__)
        return 2
    patterns = argv[1:]
    listing = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                             capture_output=True, text=True, check=True).stdout
    status = {}
    for line in listing.splitlines():
        name, sep, state = line.strip().rpartition(": ")
        if sep and name and (not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)):
            status[name] = state
    if not status:
        print("no mutants found: run `mutmut run` first")
        return 1
    counts = collections.Counter(status.values())
    reached = counts["killed"] + counts["timeout"] + counts["survived"]
    import mutmut
    import torch

    result = {
        "command": "OMP_NUM_THREADS=1 mutmut run --max-children 2 " + " ".join(f"'{p}'" for p in patterns)
                   + "  (config: pyproject.toml [tool.mutmut])",
        "mutmut": mutmut.__version__,
        "torch": torch.__version__,
        "device": "CPU",
        "counts": dict(sorted(counts.items())),
        "score": round((counts["killed"] + counts["timeout"]) / reached, 3) if reached else None,
        "survivors": sorted(n for n, s in status.items() if s == "survived"),
        "no_tests": sorted(n for n, s in status.items() if s in ("no tests", "tests")),
    }
    Path(argv[0]).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{counts}: score {result['score']} -> {argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
