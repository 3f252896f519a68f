"""The simulated device against programs recorded on the H200: capture rules, model code, random programs.

``data/fuzz`` holds 300 programs the H200 ran with memory history on (scripts/record_fuzz.py):
CUDA's capture rules, ordinary transformers scripts (four families, float32 built and
converted or built in bfloat16, eager and sdpa attention, use_cache on and off, both
capture orders, inference_mode and no_grad), one-operation probes, and random programs of
the operations model code uses. Here each runs again on a fresh layout-only simulated
device and is compared with its recording:

* a capture rule must end as on the GPU: the same error (type, message, line, and the error
  it was raised while handling) or none, the same pools and the same trace;
* a model script must leave every graph pool identical block for block, end as on the GPU,
  and differ in its trace only by what ``known_differences.json`` lists for it;
* a random program must agree in full (pools, every trace event, its error), or differ
  exactly as listed (its first difference, by cause), so a new difference fails, and so
  does a listed one that went away.

CI runs every rule, a model script of each family and a seeded sample of the random
programs; ``make fuzz-sim-replay`` (``GRAPHBORROW_FUZZ=all``) runs every program.
"""

from __future__ import annotations

import os
import random

import pytest

from graphborrow.fidelity.compare import compare_snapshots
from graphborrow.fidelity.fuzz.corpus import check, known_differences, program_of, read_corpus
from graphborrow.fidelity.fuzz.run import gpu_addresses, gpu_streams, simulate_program

pytestmark = pytest.mark.slow

FULL = os.environ.get("GRAPHBORROW_FUZZ") == "all"
SAMPLE = 10  # random programs per CI run
MODELS_IN_CI = {"model_llama-fp32-to-bf16", "model_qwen2-direct-bf16-smallest-nograd", "model_mistral-fp32-to-bf16",
                "model_llama-eager-graphs", "model_llama-tiny-cpu-built"}
LISTED = known_differences()
RULES = list(read_corpus(["rule"]))
MODELS = [r for r in read_corpus(["model"]) if FULL or r["name"] in MODELS_IN_CI]
_FUZZ = list(read_corpus(["fuzz"]))
FUZZ = _FUZZ if FULL else random.Random(22).sample(_FUZZ, SAMPLE)


def _ids(recs):
    return [r["name"] for r in recs]


def test_the_corpus_was_recorded_on_the_h200_with_seeds_and_sources():
    kinds = {kind: len(list(read_corpus([kind]))) for kind in ("fuzz", "rule", "probe", "model")}
    assert sum(kinds.values()) >= 300 and kinds["fuzz"] >= 240 and kinds["model"] >= 20
    for rec in RULES[:3] + _FUZZ[:3]:
        assert rec["device"] == "NVIDIA H200" and rec["torch"].startswith("2.11")
        assert rec["source"] and len(rec["lines"]) == len(rec["trace"])
    names = [r["name"] for r in _FUZZ]
    assert len(set(names)) == len(names) and all(n.startswith(f"fuzz{r['seed']:04d}") for n, r in zip(names, _FUZZ))
    families = {r["name"].split("_")[1].split("-")[0] for r in read_corpus(["model"])}
    assert families >= {"llama", "qwen2", "mistral", "phi3", "gemma"}


@pytest.mark.parametrize("rec", RULES, ids=_ids(RULES))
def test_capture_rules_end_as_on_the_h200(rec):
    result = check(rec)
    assert result.errors_agree, result.summary()  # the rule itself: refused or accepted, message and line
    _agrees_or_differs_as_listed(rec, result)


def _agrees_or_differs_as_listed(rec, result):
    listed = LISTED.get(rec["name"])
    if listed is None:
        assert result.agrees, result.summary()
    else:
        assert not result.agrees, f"{rec['name']} agrees now: delete it from data/fuzz/known_differences.json"
        assert result.first_difference == listed["first_difference"], (
            f"{rec['name']} differs at {result.first_difference!r}, listed {listed['first_difference']!r}")


@pytest.mark.parametrize("rec", MODELS, ids=_ids(MODELS))
def test_ordinary_model_code_leaves_the_h200_graph_pools(rec):
    sim = simulate_program(program_of(rec), addresses=gpu_addresses(rec), capacity=rec.get("total_memory"),
                           streams=gpu_streams(rec))
    graph_pools = [[s for s in r["segments"] if tuple(s["segment_pool_id"]) != (0, 0)] for r in (rec, sim)]
    pools = compare_snapshots(*graph_pools)
    assert pools.identical, pools.summary()
    result = check(rec)
    assert result.errors_agree, result.summary()
    listed = LISTED.get(rec["name"])
    if listed is None:
        assert result.agrees, result.summary()
    else:
        assert result.pools.causes() == listed["causes"], (
            f"{rec['name']}: differences {result.pools.causes()} are not the listed ones {listed['causes']}; "
            "model the new ones in graphborrow/sim or list them in data/fuzz/known_differences.json")


@pytest.mark.parametrize("rec", FUZZ, ids=_ids(FUZZ))
def test_random_model_code_programs_agree_or_differ_as_listed(rec):
    _agrees_or_differs_as_listed(rec, check(rec))


def test_differences_in_conversions_and_common_operations_only_shrink():
    """The goal is none; until then their number is a ratchet (scripts/list_fuzz_differences.py writes it)."""
    import json

    from graphborrow.fidelity.fuzz.corpus import CORPUS

    common = ("conversion", "linear", "attention", "softmax", "norm", "embedding", "cat", "elementwise", "factory")
    recorded = json.loads((CORPUS / "known_differences.json").read_text())["in_common_operations"]
    listed = [e for e in LISTED.values() if e["operation"] in common]
    assert all(e["operation"] and e["cause"] for e in LISTED.values())
    assert not any(e["operation"] == "conversion" for e in listed), "a conversion differs: fix it, never list it"
    assert len(listed) == recorded


def test_a_seed_draws_the_same_program_in_every_process():
    import subprocess
    import sys

    code = ("from graphborrow.fidelity.fuzz.generate import generate; import hashlib; "
            "print(hashlib.sha256(''.join(generate(s).source for s in range(40)).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout for seed in (1, 2)}
    assert len(digests) == 1
