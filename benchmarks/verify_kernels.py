"""Fused (Triton) EAGLE verification against the PyTorch reference and the upstream kernel, eager and replayed.

    python benchmarks/verify_kernels.py --out data/verify_kernels_h200.json --profile
    python benchmarks/verify_kernels.py --only renorm [--profile]   # the standalone renorm point alone
    python benchmarks/verify_kernels.py --only host --out before.json  # the host-time profile alone

For every bs in --batches and D in --drafts (V = --vocab, fp32 logits, temperature
--temperature, draft trees as in the upstream measurement: D=4 topk 1 depth 3, D=8 topk 4
depth 3, D=16 topk 4 depth 5; each candidate holds 10-70 % of its parent's row, so paths
are accepted and rejected) it times the public call, ``eagle_verify(impl="fused",
validate=False)``, as a serving engine makes it:

- ``device_us``: *eager*, CUDA events around the Python call, one call at a time (the
  host's launch time counts whenever the GPU waits for it); ``host_us``: the call's wall
  time on the host, the GPU idle before it; ``host_issued_us``: the host's time per call of
  calls issued back to back (nothing waits for the GPU between them); ``host_out_us``: the
  same call writing into the previous result's tensors (``out=``: nothing allocated, the
  serving loop's form); ``triton_launcher_host_us``: ``host_us`` with the kernel launched
  through Triton's C launcher (``GRAPHBORROW_DIRECT_LAUNCH=0``, the package's launch before
  its direct one); ``python_short_path_host_us`` / ``python_short_path_host_out_us``:
  ``host_us`` / ``host_out_us`` through the short path in Python, the compiled router
  (:mod:`graphborrow.eagle.triton.eager_call`) set aside; ``pipelined_us``: the time per
  call of --iters calls issued back to back (host work overlapping the GPU's, as in a
  serving loop);
- ``graph_us``: *replayed*, the same call captured by hand in a CUDA graph, events around
  ``replay()``; ``graph_path_us`` / ``graph_path_pipelined_us``: ``eagle_verify(...,
  graph=True)``, the built-in capture-once-replay-after path (where the package has it),
  and ``graph_path_replay_us``: that path through ``CUDAGraph.replay`` instead of its
  direct launch of the graph's executable;
- ``softmax_us``: one torch.softmax pass over the same logits (``softmax_with_temperature_us``:
  with upstream's division by the temperature first, ``torch.softmax(logits / T)``: the
  same-run table's "softmax" column, 1534 us at 128 x 16 where the plain pass takes about
  1100, and so the yardstick of issue 23's "replayed <= 0.6x one softmax pass"); ``reference``: eagle_verify
  with impl="reference"; the tokens checked against the reference over
  target_probs_reference (``agrees``) and eagle_verify's reference path;
  ``upstream_semantics``: the reference kernel over ``torch.softmax`` probabilities
  (upstream's step: same accept decisions? same tokens? for each differing token, where
  the coin fell relative to the CDF boundary under both sets of probabilities);
- the same with top_k=50, top_p=0.9 (``fused_renorm``);
- ``upstream``: the same-run figures of ../shared/reference/upstream_kernel_h200.md
  (softmax + sgl-kernel eager and replayed; not rebuilt here).

``--profile`` adds, at a few points, device time per kernel and the host-time profile
(after every timing: once torch.profiler has started, every later launch in the process is
slower, the softmax yardstick's most):
launches and allocations per call, the host time with every launch through Triton's JIT
front end (``jit_host_us``), and the Python functions the call spends its time in
(cProfile). Then: the standalone top-p renorm of 32 x V (and both standalone renorms at
``RENORM_ROWS`` rows, eager against replayed), and fused verification in
borrowed memory. A table says per point whether each goal of issue 23 is met.

The package is imported from this file's tree (``--package TREE``: another tree, so the
same measurements of an older version make a before/after record; ``--before`` embeds
such a record in this one).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import json
import math
import os
import platform
import pstats
import sys
import time
import traceback
from pathlib import Path

import torch


def _package_tree(argv) -> Path:
    """The tree whose graphborrow is measured: --package, else this file's (read before importing it)."""
    for i, a in enumerate(argv):
        if a == "--package" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if a.startswith("--package="):
            return Path(a.split("=", 1)[1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_package_tree(sys.argv)))

from timing import captured, event_us, host_us, issued_us, pipelined_us  # noqa: E402

from graphborrow.core.borrow import BorrowState  # noqa: E402
from graphborrow.device import get_backend  # noqa: E402
from graphborrow.eagle import eagle_verify, tree_speculative_sampling_target_only  # noqa: E402
from graphborrow.eagle.draft_tree import build_draft_tree  # noqa: E402
from graphborrow.eagle.probs import target_probs_reference  # noqa: E402
from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs  # noqa: E402
from graphborrow.eagle.triton import select as fs  # noqa: E402
from graphborrow.eagle.triton.fused import fused_workspace_bytes  # noqa: E402

try:  # (an older version has no plans: every launch went through Triton's JIT front end)
    from graphborrow.eagle.triton.fused import clear_plans  # noqa: E402
except ImportError:
    clear_plans = None

TREES = {4: (1, 3), 8: (4, 3), 16: (4, 5)}
# upstream_kernel_h200.md "Same run, both sides": (bs, D) -> (softmax, upstream eager, upstream replayed) us
UPSTREAM_SAME_RUN = {
    (1, 4): (61, 113, 92), (4, 4): (63, 109, 89), (16, 4): (85, 164, 151), (32, 4): (128, 223, 211),
    (64, 4): (213, 333, 319), (128, 4): (409, 559, 546), (1, 8): (61, 122, 100), (4, 8): (54, 114, 105),
    (16, 8): (122, 210, 200), (32, 8): (207, 314, 307), (64, 8): (402, 549, 539), (128, 8): (781, 992, 981),
    (1, 16): (56, 104, 91), (4, 16): (78, 157, 149), (16, 16): (208, 310, 298), (32, 16): (403, 539, 527),
    (64, 16): (781, 982, 973), (128, 16): (1534, 1860, 1846),
}
FLASHINFER_TOP_P_US, FLASHINFER_VOCAB = 87.0, 152064
PROFILE_POINTS = {(1, 4), (1, 8), (16, 8), (128, 16)}
RENORM = {"top_ks": 50, "top_ps": 0.9}
GOALS = {"host_us": 40.0, "replayed_vs_softmax": 0.6, "graph_path_vs_manual": 1.1, "renorm_eager_vs_replayed": 1.5}


def temporaries(fn):
    """Peak bytes the call allocated beyond what it returns (CUDA caching allocator stats)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    return torch.cuda.max_memory_allocated() - base - kept, out


def make_case(bs, d, vocab, seed, temperature=1.0):
    """Logits whose parent rows give each child ln(V) + 2 nats (the noise's log-mean) plus
    [-2.5, 1], scaled by the temperature: a child then holds 7-73 % of its row, as a
    trained draft's would."""
    topk, depth = TREES[d]
    tree = build_draft_tree(topk, depth, d, bs, vocab, generator=torch.Generator().manual_seed(seed), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = 2.0 * temperature * torch.randn(bs * d, vocab, device="cuda", generator=g)
    rows = torch.arange(bs * d, device="cuda").view(bs, d)
    centre = temperature * (math.log(vocab) + 2.0)
    for n in range(d):
        child = tree.retrive_next_token[:, n]
        for _ in range(d):
            ok = child >= 0
            if not bool(ok.any()):
                break
            spread = 3.5 * torch.rand(int(ok.sum()), device="cuda", generator=g) - 2.5
            logits[rows[:, n][ok], tree.candidates[ok, child[ok]]] = centre + temperature * spread
            child = torch.where(ok, tree.retrive_next_sibling.gather(1, child.clamp(min=0).unsqueeze(1)).squeeze(1),
                                child)
    coins = torch.rand(bs, d, device="cuda", generator=g)
    coins_final = torch.rand(bs, device="cuda", generator=g)
    return tree, logits, coins, coins_final


def kernel_over(probs, tree, coins, coins_final):
    """Upstream's kernel semantics (the reference kernel) over full [bs, D, V] probabilities."""
    bs, d = tree.candidates.shape
    out = (torch.zeros(bs * d, dtype=torch.int32, device="cuda"),
           torch.full((bs, tree.tree_depth), -1, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, dtype=torch.int32, device="cuda"))
    tree_speculative_sampling_target_only(*out, tree.candidates, tree.retrive_index, tree.retrive_next_token,
                                          tree.retrive_next_sibling, coins, coins_final, probs.view(bs, d, -1),
                                          torch.zeros_like(probs).view(bs, d, -1))
    return out[0], out[1], out[2] + 1


def differing_requests(expected, got, bs, d):
    """Requests whose accept decisions differ, and those whose emitted tokens differ."""
    accepts = ((expected[1] != got[1]).any(dim=1) | (expected[2] != got[2])).nonzero().flatten().tolist()
    tokens = (expected[0].view(bs, d) != got[0].view(bs, d)).any(dim=1).nonzero().flatten().tolist()
    return accepts, tokens


def final_residuals(probs, tree, out):
    """Each request's final residual row (float64): its final node's row of ``probs``, its
    rejected children zeroed unless every depth was accepted, as the sample draws from."""
    bs, d = tree.candidates.shape
    lengths = out[2].tolist()
    slots = out[1].gather(1, (out[2] - 1).long().unsqueeze(1)).squeeze(1).tolist()
    next_token, next_sibling = tree.retrive_next_token.tolist(), tree.retrive_next_sibling.tolist()
    candidates = tree.candidates.tolist()
    rows = probs[[s for s in slots]].double()  # slot b * D + node is the node's row
    for b in range(bs):
        if lengths[b] - 1 == tree.tree_depth - 1:
            continue  # every depth accepted: nothing subtracted
        child = next_token[b][slots[b] - b * d]
        while child >= 0:
            rows[b, candidates[b][child]] = 0.0
            child = next_sibling[b][child]
    return rows


def upstream_semantics(logits, tree, coins, coins_final, temperature, got):
    """Our fused tokens against upstream's step (the reference kernel over torch.softmax):
    differing accept decisions and tokens, and ``expected_token_flips``: the number of
    final tokens the two sets of probabilities are expected to sample differently for
    uniform coins, the sum over requests of the L1 distance between their residual CDFs
    (the measure of coins that land between two boundaries that moved)."""
    bs, d = tree.candidates.shape
    probs_up = torch.softmax(logits / temperature, dim=-1)
    upstream = kernel_over(probs_up, tree, coins, coins_final)
    accepts, tokens = differing_requests(upstream, got, bs, d)
    out = {"same_accepts": not accepts, "differing_accept_requests": len(accepts), "same_tokens": not tokens,
           "differing_token_requests": len(tokens)}
    if not accepts:
        ours = final_residuals(target_probs_reference(logits, temperature), tree, got)
        theirs = final_residuals(probs_up, tree, got)
        cdf_ours, cdf_up = ours.cumsum(1), theirs.cumsum(1)
        distance = (cdf_ours / cdf_ours[:, -1:] - cdf_up / cdf_up[:, -1:]).abs().sum(dim=1)
        out["expected_token_flips"] = float(distance.sum())
        out["tokens"] = []
        for b in tokens[:4]:  # where the coin fell: between the two sides' CDF at the lower token
            slot = int(got[1][b, int(got[2][b]) - 1])
            lower = min(int(got[0][slot]), int(upstream[0][slot]))
            out["tokens"].append({
                "request": b, "ours": int(got[0][slot]), "upstream": int(upstream[0][slot]),
                "coin": float(coins_final[b]), "cdf_ours_at_lower": float(cdf_ours[b, lower] / cdf_ours[b, -1]),
                "cdf_upstream_at_lower": float(cdf_up[b, lower] / cdf_up[b, -1])})
    return out


def kernel_breakdown(fn, iters=5):
    """Device microseconds per kernel name for one call (torch.profiler, mean over iters), and
    the number of kernels one call launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel, launches = {}, 0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            per_kernel[e.key] = round(t / iters, 2)
            launches += e.count
    return per_kernel, launches / iters


def host_profile(fn, iters, jit_fn=None):
    """Where one call's host time goes: kernels launched and allocations made per call, the
    Python functions it spends its time in (cProfile's own time per call, inflated by the
    profiler but in proportion), and, given ``jit_fn`` (the same call with every launch
    through Triton's JIT front end), that call's host time."""
    _, launches = kernel_breakdown(fn)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    allocations = (torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before) / iters
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:14]
    functions = [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls_per_call": v[1] / iters,
                  "own_us_per_call": v[2] / iters * 1e6} for k, v in top]
    record = {"launches_per_call": launches, "allocations_per_call": allocations, "python_functions": functions}
    if jit_fn is not None:
        record["jit_host_us"] = host_us(jit_fn, iters)
    return record


GRAPH_PATH = "graph" in inspect.signature(eagle_verify).parameters  # (an older version has none)
OUT_ARG = "out" in inspect.signature(eagle_verify).parameters
try:  # the switch back to Triton's launcher and CUDAGraph.replay (an older version has no direct launches)
    from graphborrow.eagle.triton.launch import DIRECT_ENV  # noqa: E402
except ImportError:
    DIRECT_ENV = None


try:  # the compiled short path's routes (an older version has none)
    from graphborrow.eagle.triton import eager_call  # noqa: E402
    from graphborrow.eagle.triton.eager import ROUTES  # noqa: E402
except ImportError:
    eager_call = ROUTES = None


@contextlib.contextmanager
def python_short_path():
    """Calls inside take the short path in Python (the compiled router set aside), for a
    same-run comparison of the two."""
    router, ROUTES.router = ROUTES.router, None
    try:
        yield
    finally:
        ROUTES.router = router


@contextlib.contextmanager
def tritons_launcher():
    """Calls inside launch through Triton's C launcher and ``CUDAGraph.replay`` (the package's
    launches before its direct ones), for a same-run comparison: plans and graph entries are
    dropped on the way in and out, so each side makes its own."""
    from graphborrow.eagle.graphs import clear_verify_graphs

    os.environ[DIRECT_ENV] = "0"
    clear_plans()
    clear_verify_graphs()
    try:
        yield
    finally:
        os.environ.pop(DIRECT_ENV)
        clear_plans()
        clear_verify_graphs()


def fused_row(common, step, renorm, args, tree, logits, coins, coins_final):
    """One point's fused timings and checks (eager, replayed by hand, the graph path)."""
    bs, d, vocab = common["bs"], common["draft_tokens"], common["vocab"]
    t = args.temperature
    row = {**common, "impl": "fused_renorm" if renorm else "fused"}
    row["temporary_bytes"], got = temporaries(step)
    row["full_vocab_temporaries"] = row["temporary_bytes"] >= 4 * bs * vocab  # not even one [bs, V] row set
    row["workspace_bytes"] = fused_workspace_bytes(bs, d, vocab, bool(renorm), bool(renorm))  # (may share the outputs')
    row["device_us"] = event_us(step, args.iters)
    row["host_us"] = host_us(step, args.host_iters)
    row["host_issued_us"] = issued_us(step, args.host_iters)
    row["pipelined_us"] = pipelined_us(step, args.iters)
    graph = captured(step)
    row["graph_us"] = event_us(graph.replay, args.iters)
    row["graph_pipelined_us"] = pipelined_us(graph.replay, args.iters)
    del graph
    call = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False, **renorm)  # step()'s arguments
    if GRAPH_PATH:
        kw = dict(call, graph=True)

        def graph_path():
            return eagle_verify(logits, None, tree, t, **kw)

        same = all(torch.equal(a, b) for a, b in zip(graph_path(), got))  # (the first call captures)
        row["graph_path_us"] = event_us(graph_path, args.iters)
        row["graph_path_pipelined_us"] = pipelined_us(graph_path, args.iters)
        row["graph_path_host_us"] = host_us(graph_path, args.host_iters)
        row["graph_path_agrees"] = same and all(torch.equal(a, b) for a, b in zip(graph_path(), got))
    if OUT_ARG:  # the serving loop's form: the previous result's buffers passed back, nothing allocated
        out = step()

        def into_out():
            return eagle_verify(logits, None, tree, t, out=out, **call)

        row["host_out_us"] = host_us(into_out, args.host_iters)
        row["host_out_issued_us"] = issued_us(into_out, args.host_iters)
        row["out_agrees"] = all(torch.equal(a, b) for a, b in zip(into_out(), got))
    if ROUTES is not None and ROUTES.router is not None:  # the same call through the short path in Python
        with python_short_path():
            row["python_short_path_host_us"] = host_us(step, args.host_iters)
            row["python_short_path_agrees"] = all(torch.equal(a, b) for a, b in zip(step(), got))
            if OUT_ARG:
                row["python_short_path_host_out_us"] = host_us(into_out, args.host_iters)
    if DIRECT_ENV is not None:  # the same calls through Triton's launcher and CUDAGraph.replay
        with tritons_launcher():
            step()
            step()  # (the first call compiles through the JIT front end)
            row["triton_launcher_host_us"] = host_us(step, args.host_iters)
            row["triton_launcher_agrees"] = all(torch.equal(a, b) for a, b in zip(step(), got))
            if GRAPH_PATH:
                graph_path()
                row["graph_path_replay_us"] = event_us(graph_path, args.iters)
                row["graph_path_replay_host_us"] = host_us(graph_path, args.host_iters)
        step()
        step()
    row["vs_softmax"] = row["device_us"] / row["softmax_us"]
    row["graph_vs_softmax"] = row["graph_us"] / row["softmax_us"]
    row["graph_vs_softmax_t"] = row["graph_us"] / row["softmax_with_temperature_us"]  # (the goal's ratio)
    probs = target_probs_reference(logits, t, renorm.get("top_ks"), renorm.get("top_ps"))
    exact = kernel_over(probs, tree, coins, coins_final)
    accepts, tokens = differing_requests(exact, got, bs, d)
    row["agrees"] = not accepts and not tokens
    row["mismatched_requests"] = len(set(accepts) | set(tokens))
    row["accept_length_mean"] = float(got[2].float().mean())
    if not renorm:
        row["upstream_semantics"] = upstream_semantics(logits, tree, coins, coins_final, t, got)
    return row, got


def run_point(bs, d, args, rows):
    vocab, t = args.vocab, args.temperature
    tree, logits, coins, coins_final = make_case(bs, d, vocab, seed=bs * 100 + d, temperature=t)
    softmax_us = event_us(lambda: torch.softmax(logits, dim=-1), args.iters)  # one pass, without the division
    common = {"bs": bs, "draft_tokens": d, "vocab": vocab, "temperature": t, "softmax_us": softmax_us,
              "softmax_with_temperature_us": event_us(lambda: torch.softmax(logits / t, dim=-1), args.iters)}
    up = UPSTREAM_SAME_RUN.get((bs, d))
    if up and vocab == 128256:
        rows.append({**common, "impl": "upstream", "device_us": float(up[1]), "replayed_us": float(up[2]),
                     "softmax_us_upstream_run": float(up[0]), "host_us": None,
                     "temporary_bytes": 4 * 2 * bs * d * vocab,
                     "source": "shared/reference/upstream_kernel_h200.md, same run, both sides"})
    for renorm in ({}, RENORM):
        kw = dict(coins=coins, coins_final=coins_final, **renorm)
        tag = "_renorm" if renorm else ""
        ref = None
        if not renorm or bs * d <= args.reference_renorm_rows:
            def reference():
                return eagle_verify(logits, None, tree, t, mode="standard", impl="reference", **kw)
            row = {**common, "impl": "reference" + tag}
            try:
                row["temporary_bytes"], ref = temporaries(reference)
                row["device_us"] = event_us(reference, args.reference_iters, warmup=1)
                row["ok"] = True
            except Exception as exc:  # noqa: BLE001 (recorded, the sweep goes on)
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            rows.append(row)

        def step():
            return eagle_verify(logits, None, tree, t, impl="fused", validate=False, **kw)

        try:
            row, got = fused_row(common, step, renorm, args, tree, logits, coins, coins_final)
            if ref is not None:
                row["agrees_eagle_verify"] = not any(differing_requests(ref, got, bs, d))
            row["ok"] = True
        except Exception as exc:  # noqa: BLE001
            row = {**common, "impl": "fused" + tag, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=6)}
        rows.append(row)


def kernel_rows(args, rows):
    """Device time per kernel at PROFILE_POINTS, into their fused rows. Run after every
    timing: once torch.profiler has started (CUPTI), every later launch in the process
    costs more, the two-launch softmax yardstick most (75 against 57 us at 4 x 4, docs/kernels.md)."""
    for row in rows:
        point = (row["bs"], row["draft_tokens"])
        if row.get("impl") not in ("fused", "fused_renorm") or not row.get("ok") or point not in PROFILE_POINTS:
            continue
        bs, d = point
        tree, logits, coins, coins_final = make_case(bs, d, args.vocab, seed=bs * 100 + d,
                                                     temperature=args.temperature)
        kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False,
                  **(RENORM if row["impl"] == "fused_renorm" else {}))
        try:
            row["per_kernel_us"], row["launches_per_call"] = kernel_breakdown(
                lambda: eagle_verify(logits, None, tree, args.temperature, **kw))
            print(f"per kernel, {row['impl']} bs={bs} D={d} ({row['launches_per_call']:.0f} launches): "
                  + ", ".join(f"{k[:40]} {v:.1f}" for k, v in row["per_kernel_us"].items()))
        except Exception as exc:  # noqa: BLE001
            row["per_kernel_error"] = f"{type(exc).__name__}: {exc}"


def host_floor(args):
    """Host time of the pieces any eager step is made of, on this machine: one CUDA
    allocation, one torch kernel launch, one CUDA graph replay."""
    x = torch.zeros(1024, device="cuda")
    graph = captured(lambda: x.add_(1))
    return {"torch_empty_us": host_us(lambda: torch.empty(1024, device="cuda"), args.iters * 10),
            "torch_add_us": host_us(lambda: x.add_(1), args.iters * 10),
            "graph_replay_us": host_us(graph.replay, args.iters * 10),
            "torch_add_issued_us": issued_us(lambda: x.add_(1), args.iters * 10)}


def host_rows(args):
    """The host-time profile of the eager public call at PROFILE_POINTS, plain and with renorm."""
    out = []
    for bs, d in sorted(PROFILE_POINTS):
        tree, logits, coins, coins_final = make_case(bs, d, args.vocab, seed=bs * 100 + d)
        for renorm in ({}, RENORM):
            kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False, **renorm)

            def step():
                return eagle_verify(logits, None, tree, args.temperature, **kw)

            record = {"bs": bs, "draft_tokens": d, "renorm": bool(renorm)}
            try:
                step()
                record["host_us"] = host_us(step, args.iters * 5)
                record["host_issued_us"] = issued_us(step, args.iters * 5)
                record.update(host_profile(step, args.iters * 5, jit_step(step)))
            except Exception as exc:  # noqa: BLE001
                record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            out.append(record)
    return out


def jit_step(step):
    """``step`` with every launch through Triton's JIT front end (each call forgets the
    plans' compiled kernels), where the package launches compiled kernels directly."""
    if clear_plans is None:
        return None  # a version without plans: every launch already goes through the JIT

    def slow():
        clear_plans()
        return step()

    return slow


def chunked_rows(args):
    """Fused verification borrowing from a captured graph's idle runs vs without a borrow."""
    backend = get_backend("cuda")
    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    keep = []
    for mib in (256, 192):  # graphs whose intermediates leave idle runs in the pool
        x = torch.ones(mib * 2**20 // 4, device="cuda")
        g = torch.cuda.CUDAGraph()
        with state.capture_scope(), backend.graph(g, pool=state.pool_id):
            t = x * 2
            u = t + 1
            out = u[:8].clone()
            del t, u
        keep.append((g, x, out))
    out_rows = []
    for bs, d in ((64, 8), (128, 8), (128, 16)):
        tree, logits, coins, coins_final = make_case(bs, d, args.vocab, seed=bs + d)
        kw = dict(coins=coins, coins_final=coins_final, validate=False, impl="fused")
        row = {"bs": bs, "draft_tokens": d, "vocab": args.vocab}
        try:
            whole = event_us(lambda: eagle_verify(logits, None, tree, 1.0, **kw), args.iters)
            state.retire()
            borrowed = event_us(lambda: eagle_verify(logits, None, tree, 1.0, borrow=state, **kw), args.iters)
            a = eagle_verify(logits, None, tree, 1.0, **kw)
            b = eagle_verify(logits, None, tree, 1.0, borrow=state, **kw)
            row.update(unchunked_us=whole, chunked_borrowed_us=borrowed, ratio=borrowed / whole,
                       agrees=all(torch.equal(x, y) for x, y in zip(a, b)), ok=True)
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        out_rows.append(row)
    state.retire()
    return out_rows


RENORM_ROWS = (8, 32, 128)  # the standalone renorms' row counts (32: the earlier record's point)


def renorm_probs(rows, vocab, seed):
    """The standalone renorms' input: softmax of N(0, 2^2) logits, [rows, vocab] on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(rows, vocab, device="cuda", generator=g), dim=-1)


def renorm_row(args):
    """The standalone top-p 0.9 (and top-k 50) renorm of 32 x V against the reference and the
    flashinfer-class goal, then both renorms at every ``RENORM_ROWS`` count: eager (device
    time, host time, host time issued back to back) against replayed by hand."""
    rows, vocab = 32, args.vocab
    probs = renorm_probs(rows, vocab, seed=0)

    def top_p():
        return fs.top_p_renorm(probs, 0.9, validate=False)

    fused = event_us(top_p, args.iters)
    reference = event_us(lambda: top_p_renorm_probs(probs, 0.9), args.reference_iters, warmup=1)
    goal = 2 * FLASHINFER_TOP_P_US * vocab / FLASHINFER_VOCAB
    graph = captured(top_p)
    record = {"rows": rows, "vocab": vocab, "top_p": 0.9, "fused_us": fused, "reference_us": reference,
              "flashinfer_class_us": FLASHINFER_TOP_P_US * vocab / FLASHINFER_VOCAB, "goal_us": goal,
              "agrees": torch.equal(fs.top_p_renorm(probs, 0.9), top_p_renorm_probs(probs, 0.9)),
              "fused_graph_us": event_us(graph.replay, args.iters), "fused_host_us": host_us(top_p, args.iters),
              "top_k50_fused_us": event_us(lambda: fs.top_k_renorm(probs, 50, validate=False), args.iters),
              "top_k50_agrees": torch.equal(fs.top_k_renorm(probs, 50), top_k_renorm_probs(probs, 50))}
    record["meets_goal"] = min(fused, record["fused_graph_us"]) <= goal  # device time: eager may wait on the host
    record["standalone"] = standalone_renorm_rows(args)
    return record


def renorm_profile(args, record):
    """The standalone top-p renorm's per-kernel and host profile, into ``record`` (after every timing)."""
    probs = renorm_probs(32, args.vocab, seed=0)  # renorm_row's

    def top_p():
        return fs.top_p_renorm(probs, 0.9, validate=False)

    top_p()
    record["per_kernel_us"] = kernel_breakdown(top_p)[0]
    record["host_profile"] = host_profile(top_p, args.iters)


def standalone_renorm_rows(args):
    """Each standalone renorm eager and replayed at ``RENORM_ROWS`` rows: issue 23's
    "renorm steps launched eagerly at <= 1.5x their replayed time", for the renorm alone."""
    out = []
    for rows in RENORM_ROWS:
        probs = renorm_probs(rows, args.vocab, seed=rows)
        for name, fn, value, reference in (("top_p", fs.top_p_renorm, 0.9, top_p_renorm_probs),
                                           ("top_k", fs.top_k_renorm, 50, top_k_renorm_probs)):
            def call(fn=fn, value=value):
                return fn(probs, value, validate=False)

            row = {"renorm": name, "rows": rows, "vocab": args.vocab, "value": value}
            try:
                row["agrees"] = torch.equal(call(), reference(probs, value))
                row["device_us"] = event_us(call, args.iters)
                row["host_us"] = host_us(call, args.iters)
                row["host_issued_us"] = issued_us(call, args.iters)
                row["graph_us"] = event_us(captured(call).replay, args.iters)
                row["eager_vs_replayed"] = row["device_us"] / row["graph_us"]
                row["goal_met"] = row["eager_vs_replayed"] <= GOALS["renorm_eager_vs_replayed"]
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            out.append(row)
            print(f"  standalone {name} {rows} x {args.vocab}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("renorm", "rows", "vocab")), flush=True)
    return out


def compile_times(args):
    """Seconds of the first call of each kernel variant (Triton compiles then)."""
    tree, logits, coins, coins_final = make_case(2, 8, 4096, seed=1)
    times = {}
    for name, kw in (("plain", {}), ("top_k+top_p", RENORM)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eagle_verify(logits, None, tree, args.temperature, coins=coins, coins_final=coins_final, impl="fused", **kw)
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fs.top_p_renorm(torch.softmax(logits, dim=-1), 0.9)
    torch.cuda.synchronize()
    times["standalone top_p"] = time.perf_counter() - t0
    return times


def goals(rows):
    """Issue 23's goals per point: (bs, D) -> verdicts and the numbers they judge."""
    by = {}
    for r in rows:
        by.setdefault((r["bs"], r["draft_tokens"]), {})[r["impl"]] = r
    verdicts = {}
    for (bs, d), impls in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        f, up, fr = impls.get("fused", {}), impls.get("upstream", {}), impls.get("fused_renorm", {})
        if not f.get("ok"):
            verdicts[(bs, d)] = {"ok": False, "error": f.get("error")}
            continue
        # the row's own ratio, so the goal and the table cannot disagree (older records lack it)
        ratio = f.get("graph_vs_softmax_t")
        if ratio is None:
            ratio = f["graph_us"] / f["softmax_with_temperature_us"]
        v = {"ok": True, "host_us": f["host_us"] <= GOALS["host_us"],
             "host_issued_us": f.get("host_issued_us", math.inf) <= GOALS["host_us"],
             "host_out_us": f.get("host_out_us", math.inf) <= GOALS["host_us"],
             "eager_le_upstream_eager": "device_us" in up and f["device_us"] <= up["device_us"],
             "replayed_le_0.6_softmax": ratio <= GOALS["replayed_vs_softmax"],
             "same_tokens_as_reference": bool(f.get("agrees"))}
        if "graph_path_us" in f:
            v["graph_path_le_1.1_manual"] = f["graph_path_us"] <= GOALS["graph_path_vs_manual"] * f["graph_us"]
            v["graph_path_pipelined_le_1.1_manual"] = (f["graph_path_pipelined_us"]
                                                       <= GOALS["graph_path_vs_manual"] * f["graph_pipelined_us"])
        if fr.get("ok"):
            v["renorm_eager_le_1.5_replayed"] = fr["device_us"] <= GOALS["renorm_eager_vs_replayed"] * fr["graph_us"]
        verdicts[(bs, d)] = v
    return by, verdicts


def print_tables(rows):
    by, verdicts = goals(rows)
    print(f"\n{'bs':>4} {'D':>3} {'smax/T':>8} {'up eager':>8} {'up repl':>8} | {'eager':>7} {'host':>6} "
          f"{'issued':>6} {'out':>5} {'py':>5} {'triton':>6} {'pipe':>6} {'replay':>7} {'gpath':>6} {'gpipe':>6} "
          f"{'x smT':>6} | "
          f"{'rn eager':>8} {'rn repl':>8} "
          f"{'agree':>5} {'upstream tokens (expected)':>9}  goals missed")
    for (bs, d), impls in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        f, up, fr = impls.get("fused", {}), impls.get("upstream", {}), impls.get("fused_renorm", {})
        if not f.get("ok"):
            print(f"{bs:>4} {d:>3}  fused failed: {f.get('error')}")
            continue
        us = f.get("upstream_semantics", {})
        missed = [k for k, ok in verdicts[(bs, d)].items() if ok is False]
        print(f"{bs:>4} {d:>3} {f['softmax_with_temperature_us']:>8.0f} {up.get('device_us', math.nan):>8.0f} "
              f"{up.get('replayed_us', math.nan):>8.0f} | {f['device_us']:>7.0f} {f['host_us']:>6.0f} "
              f"{f.get('host_issued_us', math.nan):>6.0f} {f.get('host_out_us', math.nan):>5.0f} "
              f"{f.get('python_short_path_host_us', math.nan):>5.0f} "
              f"{f.get('triton_launcher_host_us', math.nan):>6.0f} {f['pipelined_us']:>6.0f} {f['graph_us']:>7.0f} "
              f"{f.get('graph_path_us', math.nan):>6.0f} "
              f"{f.get('graph_path_pipelined_us', math.nan):>6.0f} {f.get('graph_vs_softmax_t', math.nan):>6.2f} | "
              f"{fr.get('device_us', math.nan):>8.0f} {fr.get('graph_us', math.nan):>8.0f} "
              f"{str(f.get('agrees')):>5} {us.get('differing_token_requests', '-')!s:>3} "
              f"({us.get('expected_token_flips', math.nan):.3f})  {', '.join(missed) or '-'}")
    return verdicts


def print_host(records):
    for r in records:
        if "host_us" not in r:
            print(f"host profile bs={r['bs']} D={r['draft_tokens']} failed: {r.get('error')}")
            continue
        print(f"\nhost profile bs={r['bs']} D={r['draft_tokens']} renorm={r['renorm']}: {r['host_us']:.1f} us per call "
              f"(every launch through the JIT: {r.get('jit_host_us', math.nan):.1f} us), "
              f"{r['launches_per_call']:.1f} launches, {r['allocations_per_call']:.1f} allocations")
        for f in r["python_functions"][:8]:
            print(f"    {f['own_us_per_call']:>7.2f} us  x{f['calls_per_call']:<5.1f} {f['function']}")


def sweep(args, record, started):
    rows = []
    for d in [int(x) for x in args.drafts.split(",")]:
        for bs in [int(x) for x in args.batches.split(",")]:
            if time.monotonic() - started > args.budget_s:
                rows.append({"bs": bs, "draft_tokens": d, "vocab": args.vocab, "impl": "fused", "ok": False,
                             "error": "skipped: time budget spent"})
                continue
            try:
                run_point(bs, d, args, rows)
            except Exception as exc:  # noqa: BLE001
                rows.append({"bs": bs, "draft_tokens": d, "vocab": args.vocab, "impl": "fused", "ok": False,
                             "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)})
            torch.cuda.empty_cache()
            print(f"  bs={bs} D={d} done at {time.monotonic() - started:.0f}s", flush=True)
    record["rows"] = rows
    verdicts = print_tables(rows)
    record["goals"] = {f"{bs}x{d}": v for (bs, d), v in verdicts.items()}
    record["goals_met_points"] = {name: sum(1 for v in verdicts.values() if v.get(name))
                                  for name in next(iter(verdicts.values()), {}) if name != "ok"}
    record["goals_points"] = len(verdicts)
    print("goals met (points):", record["goals_met_points"], "of", len(verdicts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON to write (default data/verify_kernels_h200.json; with --only renorm/host, none)")
    ap.add_argument("--only", choices=("all", "renorm", "host"), default="all")
    ap.add_argument("--package", type=Path, default=None,
                    help="the tree whose graphborrow is measured (default: this file's; read before parsing)")
    ap.add_argument("--before", type=Path, default=None, help="a record of an older version to embed as 'before'")
    ap.add_argument("--batches", default="1,4,16,32,64,128")
    ap.add_argument("--drafts", default="4,8,16")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--temperature", type=float, default=0.7, help="the same-run table's (0.7)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--host-iters", type=int, default=200,
                    help="calls per host-time median at each point (host time jitters far more than GPU time)")
    ap.add_argument("--reference-iters", type=int, default=3)
    ap.add_argument("--reference-renorm-rows", type=int, default=64,
                    help="run the (slow, sort-based) reference with renorm only up to this many rows")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new points after this long")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time and the host profile")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("verify_kernels.py measures CUDA kernels: run it on a GPU machine")
    started = time.monotonic()
    given = argv if argv is not None else sys.argv[1:]
    record = {"command": " ".join(["python benchmarks/verify_kernels.py", *given]),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(), "python": platform.python_version()}
    try:
        import triton
        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    out = args.out
    if eager_call is not None:  # built before anything is timed (the first eager call would build it)
        began = time.perf_counter()
        record["compiled_eager_path"] = eager_call.module() is not None
        print(f"compiled eager path: {record['compiled_eager_path']} ({time.perf_counter() - began:.1f} s)")
    if args.only != "host":
        record["compile_s"] = compile_times(args)
        print("Triton compile (first call) seconds:", {k: round(v, 2) for k, v in record["compile_s"].items()})
    profiles = args.only in ("all", "host") and (args.profile or args.only == "host")
    if profiles:
        record["host_floor"] = host_floor(args)
        print("host floor:", {k: round(v, 1) for k, v in record["host_floor"].items()})
    if args.only == "all":
        sweep(args, record, started)
        out = out or Path("data/verify_kernels_h200.json")
        try:
            record["chunked"] = chunked_rows(args)
        except Exception as exc:  # noqa: BLE001
            record["chunked"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if args.only in ("all", "renorm"):
        try:
            record["top_p_renorm"] = renorm_row(args)
            print(f"\ntop-p renorm 32 x V: {json.dumps(record['top_p_renorm'])}")
        except Exception as exc:  # noqa: BLE001
            record["top_p_renorm"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc(limit=4)}
    if profiles:  # the profiler last: once started, it slows every later launch in the process
        record["host_profile"] = host_rows(args)
        print_host(record["host_profile"])
        if args.only == "all":
            kernel_rows(args, record.get("rows", []))
    if args.profile and isinstance(record.get("top_p_renorm"), dict) and "fused_us" in record["top_p_renorm"]:
        renorm_profile(args, record["top_p_renorm"])
    if args.before is not None:
        record["before"] = json.loads(args.before.read_text())
    if out is not None:
        record["elapsed_s"] = time.monotonic() - started
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))
        print(f"\nwrote {out} in {record['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
