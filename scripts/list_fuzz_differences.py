"""Write data/fuzz/known_differences.json from a replay of the corpus (scripts/replay_fuzz.py --json).

    python scripts/replay_fuzz.py --json output/fuzz_replay.json
    python scripts/list_fuzz_differences.py output/fuzz_replay.json

Every program that does not agree is listed with the operation at its first difference (the
program line the first differing event came from, classified by :data:`OPERATIONS`) and the
cause that operation's modelling lacks (:data:`CAUSES`); a model script is listed with its
trace differences by cause and count. tests/fidelity/test_fuzz_corpus.py then requires
exactly these, and refuses any listed difference in a conversion or an operation model code
commonly calls.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphborrow.fidelity.fuzz.corpus import CORPUS, check, read_corpus  # noqa: E402

# (operation, pattern of the program line): the first that matches names the operation
OPERATIONS = [
    ("capture rules", r"torch\.cuda\.graph|record_stream|_sleep"),
    ("randperm", r"randperm"),
    ("index_put with accumulation", r"index_put_|\]\s*=\s"),
    ("data-dependent selection", r"nonzero|masked_select|%\s*\d+\s*==\s*0\]"),
    ("sort and top-k over long rows", r"torch\.sort|argsort|topk"),
    ("full reduction", r"\.sum\(\)|\.mean\(\)|\.var\(|amax|\.max\(|argmax|vector_norm|\.any\(|\.mean\(dim"),
    ("attention", r"scaled_dot_product_attention"),
    ("softmax", r"softmax"),
    ("norm", r"layer_norm|rms_norm|rsqrt"),
    ("linear", r"F\.linear|@|matmul|bmm|baddbmm|einsum|\bm\d+\("),
    ("conversion", r"\.to\(|\.half\(|\.bfloat16\(|\.float\(|\.type\(|\.data\s*=|copy_"),
    ("embedding", r"embedding"),
    ("cat", r"torch\.cat|torch\.stack|split|chunk|unbind"),
    ("factory", r"torch\.(randn|rand|zeros|ones|empty|full|arange|randint)\("),
    ("elementwise", r"silu|gelu|exp|tanh|sigmoid|mul_|\+=|clamp_|div_|\*|\+"),
]
# operations model code commonly calls: the goal is no listed difference in them
COMMON = ("conversion", "linear", "attention", "softmax", "norm", "embedding", "cat", "elementwise", "factory")
CAUSES = {
    "capture rules": "the cuBLAS workspace a capture allocates on its stream: freed when the capture ends, and not "
                     "made again by the next capture on that stream (torch 2.11 keeps it per handle and stream); "
                     "not modelled",
    "deferred free timing": "a free deferred behind another stream's work (record_stream, with or without "
                            "torch.cuda._sleep) completes at the first allocation after that work has finished on "
                            "the GPU; the simulator does not time kernels, so it completes the free at another "
                            "allocation (the operation on that line is not involved)",
    "segment addresses": "every trace event agrees, yet equal segments hold their layouts at other addresses than "
                         "on the GPU: the recorded cudaMalloc addresses are followed size by size, and the "
                         "allocator's choice between equal free blocks (the lowest address) still differs; not yet "
                         "explained",
    "data-dependent selection": "nonzero / masked_select / boolean indexing: the count, CUB reduce and select "
                                "temporaries are not modelled (they also synchronise, so graphs cannot contain them)",
    "sort and top-k over long rows": "top-k over rows long enough for should_use_multiblock (or a slice count it "
                                     "picks): the multi-block radix select's buffers (k-th values, counters, digit "
                                     "histograms, CUB scan storage) are not modelled",
    "other": "torch.multinomial's temporaries (probe_index) are not modelled; repr of a tensor inside a capture "
             "(rule_repr_of_tensor) makes a segment on the capture stream before the capture fails: not yet "
             "explained",
}


def operation_of(line: str) -> str:
    for name, pattern in OPERATIONS:
        if re.search(pattern, line):
            return name
    return "other"


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise SystemExit("usage: list_fuzz_differences.py REPLAY.json")
    replay = json.loads(Path(args[0]).read_text())
    recs = {r["name"]: r for r in read_corpus()}
    entries = []
    for row in replay["programs"]:
        if row["agrees"] is not False:  # agrees, or had nothing to compare: no difference to list
            continue
        rec = recs[row["name"]]
        if rec["kind"] == "model":
            causes = check(rec).pools.causes()
            entries.append({"program": row["name"], "operation": "import of transformers inside the device block",
                            "cause": "import side effect: torchaudio, installed on the H200's image and not here, "
                                     "makes a 4-byte tensor when transformers first imports it inside the script's "
                                     "torch.device('cuda') block; the default pool's small segment then holds it "
                                     "(graph pools are unaffected and agree block for block)",
                            "causes": causes})
            continue
        difference = row.get("first_difference") or ""
        found = re.findall(r"at line (\d+)", difference)
        source = rec["source"].splitlines()
        line = source[int(found[0]) - 1] if found and int(found[0]) else ""
        if "'free_completed'" in difference:  # a deferred free completing elsewhere: timing, not the line's op
            operation = "deferred free timing"
        elif not difference and row.get("errors_agree", True):
            operation = "segment addresses"
        else:
            operation = operation_of(line) if line else "error"
        entries.append({"program": row["name"], "operation": operation,
                        "cause": CAUSES.get(operation, "not yet explained"), "line": line.strip(),
                        "first_difference": row.get("first_difference") or "",
                        "errors": [row.get("gpu_error"), row.get("sim_error")]})
    common = sum(e["operation"] in COMMON for e in entries)
    out = {"about": __doc__.splitlines()[0] + " Every program of data/fuzz not listed here agrees with the H200 in "
                    "full.", "replay": args[0], "in_common_operations": common, "differences": entries}
    (CORPUS / "known_differences.json").write_text(json.dumps(out, indent=1) + "\n")
    by_operation: dict[str, int] = {}
    for e in entries:
        by_operation[e["operation"]] = by_operation.get(e["operation"], 0) + 1
    print(json.dumps(by_operation, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
