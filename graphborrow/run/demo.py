"""The core demo: free runs of a captured graph ladder, one borrow and what it cost, and whether
the whole verification step fits (the capacity planner's answer, then the step itself).

    python -m graphborrow demo [--device auto|cuda|sim]

On a GPU it uses Llama-3-8B shapes; on the simulated device a tiny model with the same
structure, so the story and the numbers' meaning are the same.
"""

from __future__ import annotations

import argparse
import gc

import torch

from graphborrow.core.errors import ParameterError
from graphborrow.core.runs import find_free_runs, summarize
from graphborrow.core.sizes import MB
from graphborrow.device import get_backend
from graphborrow.eagle import eagle_verify
from graphborrow.eagle.draft_tree import build_draft_tree
from graphborrow.eagle.plan import describe_plan, plan_verify
from graphborrow.studies.model_pools import borrow_saving
from graphborrow.workloads.ladder import LLAMA3_8B, GraphLadder, ModelShape

from .sweep.parameters import argument_type

__all__ = ["main", "run_demo", "freeze_imports"]

# Small enough for a CPU, large enough that the probabilities need 20 MiB segments.
SIM_SHAPE = ModelShape(hidden=256, intermediate=1024, layers=2, vocab=32000, dtype=torch.float32)


CUDA_BATCHES = (64, 32, 16, 8, 4, 2, 1)  # the decode graphs the demo captures on a GPU
SIM_BATCHES = (16, 8, 4, 2, 1)  # and on the simulated device


def run_demo(device: str = "auto", batch: int = 16, draft_tokens: int = 4, out=print) -> dict:
    """Capture, borrow, measure, plan and verify; returns the numbers it printed.

    Args:
        device: "auto", "cuda" or "sim".
        batch, draft_tokens: the verification step (batch at most the largest captured one).
        out: where lines go.

    Returns:
        A dict: device, pool summary, where the borrow landed, device bytes borrowed and
        plain, and the verification step's plan and outcome.

    Raises:
        ParameterError: ``batch`` is larger than the largest decode graph the demo captures
            on that device (checked before anything is captured).
    """
    backend = get_backend(device)
    cuda = backend.name == "cuda"
    batches = CUDA_BATCHES if cuda else SIM_BATCHES
    if batch > max(batches):
        raise ParameterError(
            f"--batch {batch}: the demo captures decode graphs for batches {list(batches)} on the {backend.name} "
            f"device, and a step can only replay a captured batch or a smaller one; pass --batch {max(batches)} "
            "or less")
    shape = LLAMA3_8B if cuda else SIM_SHAPE
    prefill = 8192 if cuda else 4096
    out(f"device: {backend.describe()}")
    out(f"capturing a prefill graph ({prefill} tokens) and decode graphs for batch {list(batches)} "
        f"x {draft_tokens} draft tokens into one pool (hidden {shape.hidden}, vocab {shape.vocab})")
    ladder = GraphLadder(backend, shape, prefill_tokens=prefill, decode_batches=batches,
                         draft_tokens=draft_tokens).capture()
    segments = ladder.snapshot()
    s = summarize(segments)
    out(f"pool: {s['reserved_bytes'] / MB:.1f} MiB reserved in {s['segments']} segments")
    out(f"free runs (per-run rule): {s['runs']} runs, {s['run_bytes'] / MB:.1f} MiB, "
        f"largest {s['largest_run'] / MB:.1f} MiB")
    out(f"free runs (whole-segment rule): {s['whole_segment_runs']} runs, {s['whole_segment_bytes'] / MB:.1f} MiB")
    for address, nbytes in find_free_runs(segments)[:8]:
        out(f"  run at {address:#x}: {nbytes / MB:8.2f} MiB")

    state = ladder.state
    logits = ladder.decode(batch)
    rows, vocab = logits.shape
    probs_bytes = 2 * rows * vocab * 4
    out(f"verification probabilities for batch {batch} x {draft_tokens} drafts x vocab {vocab}: "
        f"{probs_bytes / MB:.2f} MiB (target + draft)")

    saving = borrow_saving(state, logits, backend)
    borrowed_cost, plain_cost = saving["borrowed_device_bytes"], saving["plain_device_bytes"]
    if borrowed_cost is None:
        out(f"borrowed: the free runs cannot hold the set ({saving['error']})")
    else:
        out(f"borrowed: tensors inside free runs = {saving['inside_runs']}; "
            f"device memory used {borrowed_cost / MB:.2f} MiB")
    out(f"plain allocation: device memory used {plain_cost / MB:.2f} MiB")
    out(f"saved by borrowing: {saving['saved_bytes'] / MB:.2f} MiB")

    plan = plan_verify(state, batch, draft_tokens, vocab, "standard")
    out(f"capacity planner: {describe_plan(plan)}")
    step = _verify_step(ladder, logits, batch, draft_tokens, state) if plan.fits else None
    if step is not None:
        out(f"the verification step ran in the borrowed runs, as planned: {step} tokens emitted")
    return {
        "device": backend.name,
        "pool": s,
        "borrowed_inside_runs": saving["inside_runs"],
        "borrowed_device_bytes": borrowed_cost,
        "plain_device_bytes": plain_cost,
        "verify_plan_fits": plan.fits,
        "verify_plan_peak_bytes": plan.peak_bytes,
        "verify_tokens_emitted": step,
    }


def _verify_step(ladder, logits, batch, draft_tokens, state) -> int:
    """Run one borrowed verification step over the decode logits; tokens it emitted."""
    tree = build_draft_tree(min(2, draft_tokens), max(draft_tokens, 1), draft_tokens, batch, logits.shape[1],
                            generator=torch.Generator().manual_seed(0), device=ladder.backend.device)
    result = eagle_verify(logits.contiguous(), None, tree, 0.8, borrow=state,
                          generator=torch.Generator().manual_seed(1))
    return int(result.accept_length.sum())


def freeze_imports() -> None:
    """Move what the imports made out of the garbage collector's way (a command's own process only):
    each graph capture collects garbage first, as ``torch.cuda.graph`` does, and with torch imported
    a full collection walks a third of a million objects."""
    gc.collect()
    gc.freeze()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphborrow demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--batch", type=argument_type("BATCH_SIZE"), default=16,
                   help=f"requests in the verified batch: at most the largest captured batch, {max(CUDA_BATCHES)} "
                        f"on a GPU and {max(SIM_BATCHES)} on the simulated device")
    p.add_argument("--draft-tokens", type=argument_type("DRAFT_TOKENS"), default=4)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device sim or auto")
    freeze_imports()
    try:
        run_demo(args.device, args.batch, args.draft_tokens)
    except ParameterError as exc:  # e.g. a batch larger than the captured ladder
        p.error(str(exc))
    return 0
