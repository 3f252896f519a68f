"""Replay every trace of the differential corpus on the simulated allocator and record the agreement.

    python scripts/replay_corpus.py [--corpus data/traces/corpus] [--json data/traces/corpus_agreement.json]
                                    [--label NAME] [--only seed001,seed002_late]

Prints one line per trace and the distribution (traces at 1.0, in [0.99, 1), [0.9, 0.99),
below 0.9, refused). With ``--json`` the run is added under ``--label`` (replacing a run of
the same label) to the file, which keeps one entry per labelled run: the agreement
distribution before and after each change of the model. Only ``replay_trace`` and the
report's ``agreement``, ``checks`` and ``mismatches`` are used, so the same script measures
older versions of the simulator too (run it with PYTHONPATH pointing at their source).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANDS = (("1.0", 1.0, 1.01), ("[0.99, 1)", 0.99, 1.0), ("[0.9, 0.99)", 0.9, 0.99), ("< 0.9", -1.0, 0.9))


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def replay_one(path: str) -> dict:
    from graphborrow.fidelity.replay import replay_trace

    snapshot = load(path)
    meta = snapshot.get("corpus", {})
    row = {"name": meta.get("name", os.path.basename(path)), "variant": meta.get("variant"),
           "settings": meta.get("settings"), "fraction": meta.get("fraction")}
    start = time.process_time()
    try:
        report = replay_trace(snapshot)
    except Exception as error:  # older simulators refuse some traces
        row.update(refused=f"{type(error).__name__}: {str(error)[:300]}")
        return row
    row.update(agreement=report.agreement, checks=report.checks, mismatches=len(report.mismatches),
               first_mismatch=report.mismatches[0][:300] if report.mismatches else None,
               cpu_s=round(time.process_time() - start, 3))
    for extra in ("unverifiable", "stats_checked", "inferred"):
        value = getattr(report, extra, None)
        if value is not None:
            row[extra] = value if not isinstance(value, (list, dict)) else len(value)
    return row


def summarize(rows: list[dict]) -> dict:
    summary = {label: 0 for label, _, _ in BANDS}
    summary["refused"] = 0
    for row in rows:
        if "refused" in row:
            summary["refused"] += 1
            continue
        for label, low, high in BANDS:
            if low <= row["agreement"] < high:
                summary[label] += 1
                break
    summary["traces"] = len(rows)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=os.path.join(REPO, "data", "traces", "corpus"))
    parser.add_argument("--json", help="add this run to a JSON file of labelled runs")
    parser.add_argument("--label", default="current")
    parser.add_argument("--commit", help="the simulator's commit, when it is not this checkout's HEAD")
    parser.add_argument("--only", help="comma-separated trace names")
    args = parser.parse_args(argv)
    names = sorted(f for f in os.listdir(args.corpus) if f.endswith((".pickle.gz", ".pickle")))
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        names = [n for n in names if n.split(".")[0] in wanted]
    if not names:
        parser.error(f"no traces (*.pickle.gz) in {args.corpus}")
    rows = []
    for name in names:
        row = replay_one(os.path.join(args.corpus, name))
        rows.append(row)
        result = row.get("refused") or f"{row['agreement']:.4f} ({row['checks']} checks)"
        print(f"{row['name']:<16} {row['variant'] or '':<14} {result}", flush=True)
    summary = summarize(rows)
    print(json.dumps(summary))
    if args.json:
        record = {"runs": []}
        if os.path.exists(args.json):
            with open(args.json) as f:
                record = json.load(f)
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                               capture_output=True, text=True).stdout.strip()
        run = {"label": args.label, "commit": commit,
               "command": "python scripts/replay_corpus.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "summary": summary, "traces": rows}
        record["runs"] = [r for r in record["runs"] if r["label"] != args.label] + [run]
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json} (run {args.label!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
