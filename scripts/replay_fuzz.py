"""Replay the committed H200 corpus on the simulated device and report agreement, program by program.

    python scripts/replay_fuzz.py                       # every kind, a table and the totals
    python scripts/replay_fuzz.py --kinds rule --verbose
    python scripts/replay_fuzz.py --json output/fuzz_agreement.json --jobs 2

Each program runs on a fresh layout-only simulated device (the GPU's cudaMalloc addresses
followed) and is compared with its recording (:func:`graphborrow.fidelity.fuzz.corpus.check`):
pools block for block, traces event for event, the error message and line. A program agrees
when all three do; one with no block, no trace event and no error on either side had nothing
to compare and is counted apart (``unchecked``), never as agreeing. ``--json`` writes the
per-program results and the totals (the figures ``make fuzz-sim-replay`` prints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphborrow.fidelity.fuzz.corpus import KINDS, check, known_differences, read_corpus  # noqa: E402


def _one(rec: dict) -> dict:
    t0 = time.perf_counter()
    try:
        result = check(rec)
    except Exception as exc:  # the simulator itself broke: report it, go on
        return {"name": rec["name"], "kind": rec["kind"], "agrees": False, "crash": f"{type(exc).__name__}: {exc}"}
    ref, cand, aligned = result.pools.trace_events
    return {"name": rec["name"], "kind": rec["kind"], "agrees": result.agrees, "blocks": result.pools.agreement_blocks,
            "events": [ref, cand, aligned], "errors_agree": result.errors_agree,
            "gpu_error": (rec.get("error") or {}).get("message"), "sim_error": (result.errors[1] or {}).get("message"),
            "first_difference": result.first_difference, "seconds": round(time.perf_counter() - t0, 2),
            "summary": result.summary() if not result.agrees else ""}


def mark(row: dict, listed) -> str:
    """agrees, unchecked (nothing to compare), listed (a known difference) or DIFFERS."""
    if row["agrees"] is None:
        return "unchecked"
    return "agrees" if row["agrees"] else ("listed" if row["name"] in listed else "DIFFERS")


def tally(rows: list[dict], listed) -> dict:
    """Programs per kind: how many, how many agree, differ as listed, or had nothing to compare."""
    totals: dict = {}
    for row in rows:
        t = totals.setdefault(row["kind"], {"programs": 0, "agree": 0, "listed": 0, "unchecked": 0})
        t["programs"] += 1
        key = {"agrees": "agree", "listed": "listed", "unchecked": "unchecked"}.get(mark(row, listed))
        if key:
            t[key] += 1
    return totals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--only", default="", help="comma-separated program names")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    recs = list(read_corpus(args.kinds.split(",")))
    if args.only:
        wanted = set(args.only.split(","))
        recs = [r for r in recs if r["name"] in wanted]
    listed = known_differences()
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(_one, recs, chunksize=1))
    else:
        rows = [_one(r) for r in recs]
    totals = tally(rows, listed)
    for row in rows:
        line = f"{row['name']:44s} {mark(row, listed):8s}"
        if row["agrees"] is False:
            line += f" {row.get('crash') or row.get('first_difference') or ''}"[:220]
            if not row.get("errors_agree", True):
                line += f" | errors GPU {row.get('gpu_error')!r} sim {row.get('sim_error')!r}"[:300]
        print(line, flush=True)
        if args.verbose and row.get("summary"):
            print("    " + row["summary"].replace("\n", "\n    "))
    print(json.dumps(totals), f"in {time.perf_counter() - t0:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        Path(args.json).write_text(json.dumps({"totals": totals, "programs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
