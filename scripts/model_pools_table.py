"""The README's real-model table from a model_pools run (GPU numbers, simulator agreement).

    python scripts/model_pools_table.py data/models_h200 --readme README.md

Reads ``<dir>/summary.json`` and the recordings beside it, rebuilds each workload on the
layout-only simulated device to report block-for-block agreement, and prints a Markdown
table; with ``--readme`` it replaces the text between the ``--marker`` markers there
(``model-pools`` for the H200 run, ``model-pools-sim`` for the simulated one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphborrow.studies.model_pools import markdown_table, replace_between_markers  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="what benchmarks/model_pools.py wrote (summary.json + recordings)")
    p.add_argument("--readme", default=None, help="replace the table between the model-pools markers in this file")
    p.add_argument("--marker", default="model-pools",
                   help="which markers enclose the table: model-pools (H200) or model-pools-sim")
    p.add_argument("--no-compare", action="store_true", help="skip the simulated rebuilds (no agreement column)")
    args = p.parse_args(argv)
    directory = Path(args.directory)
    summary = json.loads((directory / "summary.json").read_text())
    table = markdown_table(summary, directory, compare=not args.no_compare)
    print(table)
    if args.readme:
        path = Path(args.readme)
        path.write_text(replace_between_markers(path.read_text(), table, args.marker))
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
