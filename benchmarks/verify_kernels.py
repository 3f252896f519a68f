"""Fused (Triton) EAGLE verification against the PyTorch reference and the upstream kernel.

    python benchmarks/verify_kernels.py --out data/verify_kernels_h200.json
    python benchmarks/verify_kernels.py --only renorm [--profile]   # the standalone renorm point alone

For every bs in --batches and D in --drafts (V = --vocab, fp32 logits, draft trees as in
the upstream measurement: D=4 topk 1 depth 3, D=8 topk 4 depth 3, D=16 topk 4 depth 5;
each candidate holds 10-70 % of its parent's row, so paths are accepted and rejected):

- ``softmax_us``: one torch.softmax pass over the same [bs*D, V] logits (CUDA events, median);
- ``reference``: eagle_verify(mode="standard", impl="reference") — device_us, host_us, temporaries;
- ``fused``: fused_verify eager (device_us, host_us) and replayed from a CUDA graph
  (``graph_us``), temporaries (max_memory_allocated growth minus the outputs), whether it
  emitted the tokens of the reference over target_probs_reference (``agrees``) and of
  eagle_verify's reference path (``agrees_eagle_verify``; the same formula, so True is
  expected wherever the reference ran), its candidate probabilities against
  target_probs_reference and torch.softmax, and (``--profile``) device time per kernel;
- ``fused_renorm``: the same with top_k=50, top_p=0.9 (reference too at small batches);
- ``upstream``: the figures of ../shared/reference/upstream_kernel_h200.md (sgl-kernel,
  softmax + kernel, same device class; not rebuilt here).

Then: the standalone top-p renorm of 32 x V against flashinfer's ~87 us class for one
152k row (scaled by V / 152064), and fused verification chunked in borrowed memory against
unchunked. Each point is caught and recorded on failure; a table says per point whether
each goal is met. Triton compile times are printed and recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphborrow.eagle import eagle_verify, tree_speculative_sampling_target_only  # noqa: E402
from graphborrow.eagle.draft_tree import build_draft_tree  # noqa: E402
from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs  # noqa: E402
from graphborrow.eagle.triton import fused as fv  # noqa: E402

TREES = {4: (1, 3), 8: (4, 3), 16: (4, 5)}
# upstream_kernel_h200.md: (bs, D) -> (softmax us, kernel us, step us)
UPSTREAM = {
    (1, 4): (56, 40, 95), (4, 4): (66, 68, 134), (16, 4): (83, 63, 146), (32, 4): (133, 70, 203),
    (64, 4): (217, 86, 303), (128, 4): (424, 101, 525), (1, 8): (58, 41, 99), (4, 8): (64, 62, 125),
    (16, 8): (132, 67, 199), (32, 8): (213, 74, 287), (64, 8): (415, 88, 503), (128, 8): (808, 100, 908),
    (1, 16): (62, 41, 103), (4, 16): (85, 64, 149), (16, 16): (220, 69, 289), (32, 16): (421, 73, 494),
    (64, 16): (811, 87, 899), (128, 16): (1569, 102, 1671),
}
FLASHINFER_TOP_P_US, FLASHINFER_VOCAB = 87.0, 152064
PROFILE_POINTS = {(1, 4), (16, 8), (128, 16), (32, 8)}


def event_us(fn, iters, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_us(fn, iters):
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def temporaries(fn):
    """Peak bytes the call allocated beyond what it returns (CUDA caching allocator stats)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    return torch.cuda.max_memory_allocated() - base - kept, out


def graph_us(fn, iters):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    value = event_us(graph.replay, iters)
    del graph
    return value


def make_case(bs, d, vocab, seed):
    topk, depth = TREES[d]
    tree = build_draft_tree(topk, depth, d, bs, vocab, generator=torch.Generator().manual_seed(seed), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = 2.0 * torch.randn(bs * d, vocab, device="cuda", generator=g)
    # each node's row gives its children ln(V) + 2 nats (the noise's log-mean) plus [-2.5, 1]:
    # a child then holds 7-73 % of the row, as a trained draft's would
    rows = torch.arange(bs * d, device="cuda").view(bs, d)
    centre = math.log(vocab) + 2.0
    for n in range(d):
        child = tree.retrive_next_token[:, n]
        for _ in range(d):
            ok = child >= 0
            if not bool(ok.any()):
                break
            spread = 3.5 * torch.rand(int(ok.sum()), device="cuda", generator=g) - 2.5
            logits[rows[:, n][ok], tree.candidates[ok, child[ok]]] = centre + spread
            child = torch.where(ok, tree.retrive_next_sibling.gather(1, child.clamp(min=0).unsqueeze(1)).squeeze(1),
                                child)
    coins = torch.rand(bs, d, device="cuda", generator=g)
    coins_final = torch.rand(bs, device="cuda", generator=g)
    return tree, logits, coins, coins_final


def exact_reference(logits, tree, coins, coins_final, top_k=None, top_p=None):
    """Verification over target_probs_reference (the kernels' formula) with upstream's semantics."""
    bs, d = tree.candidates.shape
    probs = fv.target_probs_reference(logits, 1.0, top_k, top_p).view(bs, d, -1)
    out = (torch.zeros(bs * d, dtype=torch.int32, device="cuda"),
           torch.full((bs, tree.tree_depth), -1, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, dtype=torch.int32, device="cuda"))
    tree_speculative_sampling_target_only(*out, tree.candidates, tree.retrive_index, tree.retrive_next_token,
                                          tree.retrive_next_sibling, coins, coins_final, probs, torch.zeros_like(probs))
    return fv.FusedResult(out[0], out[1], out[2] + 1)


def kernel_breakdown(fn, iters=5):
    """Device microseconds per kernel name for one call (torch.profiler, mean over iters)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            out[e.key] = round(t / iters, 2)
    return out


def first_mismatch(tree, expected, got, coins, coins_final):
    d = tree.candidates.shape[1]
    bs = tree.candidates.shape[0]
    differs = ((expected.predicts.view(bs, d) != got.predicts.view(bs, d)).any(dim=1)
               | (expected.accept_index != got.accept_index).any(dim=1)
               | (expected.accept_length != got.accept_length))
    bad = differs.nonzero().flatten().tolist()
    if not bad:
        return 0, None
    b = bad[0]
    dump = {"request": b, "candidates": tree.candidates[b].tolist(),
            "next_token": tree.retrive_next_token[b].tolist(), "next_sibling": tree.retrive_next_sibling[b].tolist(),
            "coins": coins[b].tolist(), "coin_final": float(coins_final[b]),
            "reference": [expected.predicts.view(bs, d)[b].tolist(), expected.accept_index[b].tolist(),
                          int(expected.accept_length[b])],
            "fused": [got.predicts.view(bs, d)[b].tolist(), got.accept_index[b].tolist(), int(got.accept_length[b])]}
    return len(bad), dump


def run_point(bs, d, args, rows):
    vocab = args.vocab
    tree, logits, coins, coins_final = make_case(bs, d, vocab, seed=bs * 100 + d)
    softmax_us = event_us(lambda: torch.softmax(logits, dim=-1), args.iters)
    common = {"bs": bs, "draft_tokens": d, "vocab": vocab, "softmax_us": softmax_us}
    up = UPSTREAM.get((bs, d))
    if up and vocab == 128256:
        rows.append({**common, "impl": "upstream", "device_us": float(up[2]), "kernel_us": float(up[1]),
                     "softmax_us_upstream_run": float(up[0]), "host_us": None, "temporary_bytes": 4 * 2 * bs * d * vocab,
                     "source": "shared/reference/upstream_kernel_h200.md"})
    plain_fused = None
    for renorm in ({}, {"top_ks": 50, "top_ps": 0.9}):
        tag = "" if not renorm else "_renorm"
        kw = dict(coins=coins, coins_final=coins_final, **renorm)
        ref = None
        if not renorm or bs * d <= args.reference_renorm_rows:
            def reference():
                return eagle_verify(logits, None, tree, 1.0, mode="standard", impl="reference", **kw)
            row = {**common, "impl": "reference" + tag}
            try:
                row["temporary_bytes"], ref = temporaries(reference)
                row["device_us"] = event_us(reference, args.reference_iters, warmup=1)
                row["host_us"] = host_us(reference, args.reference_iters)
                row["ok"] = True
            except Exception as exc:  # noqa: BLE001 (recorded, the sweep goes on)
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            rows.append(row)

        def fused():
            return fv.fused_verify(logits, None, tree, 1.0, validate=False, **kw)

        row = {**common, "impl": "fused" + tag}
        plain_fused = plain_fused or row
        try:
            row["temporary_bytes"], got = temporaries(fused)
            row["full_vocab_temporaries"] = row["temporary_bytes"] >= 4 * bs * vocab  # not even one [bs, V] row set
            row["device_us"] = event_us(fused, args.iters)
            row["graph_us"] = graph_us(fused, args.iters)
            row["host_us"] = host_us(fused, args.iters)
            row["vs_softmax"] = row["device_us"] / softmax_us
            row["graph_vs_softmax"] = row["graph_us"] / softmax_us
            exact = exact_reference(logits, tree, coins, coins_final, renorm.get("top_ks"), renorm.get("top_ps"))
            n_bad, dump = first_mismatch(tree, exact, got, coins, coins_final)
            row["agrees"] = n_bad == 0
            row["mismatched_requests"] = n_bad
            if dump:
                row["first_mismatch"] = dump
            if ref is not None:
                row["agrees_eagle_verify"] = first_mismatch(tree, ref, got, coins, coins_final)[0] == 0
            row["accept_length_mean"] = float(got.accept_length.float().mean())
            if args.profile and (bs, d) in PROFILE_POINTS:
                row["per_kernel_us"] = kernel_breakdown(fused)
            row["ok"] = True
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=4))
        rows.append(row)
    # the kernel's candidate probabilities: bitwise target_probs_reference's; how often torch.softmax's
    toks = tree.candidates.repeat_interleave(d, dim=0)
    kernel_p = fv.fused_token_probs(logits, 1.0, d, toks)
    formula_p = fv.target_probs_reference(logits, 1.0).gather(1, toks)
    torch_p = torch.softmax(logits, dim=-1).gather(1, toks)
    plain_fused["candidate_probs_equal_target_probs_reference"] = float((kernel_p == formula_p).float().mean())
    plain_fused["candidate_probs_equal_torch_softmax"] = float((kernel_p == torch_p).float().mean())
    plain_fused["candidate_probs_max_rel_diff_torch_softmax"] = float(
        ((kernel_p - torch_p).abs() / torch_p.clamp(min=1e-30)).max())


def chunked_rows(args):
    """Fused verification chunked in borrowed memory (a captured graph's idle runs) vs whole."""
    from graphborrow.core.borrow import BorrowState
    from graphborrow.device import get_backend

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
        kw = dict(coins=coins, coins_final=coins_final, validate=False)
        row = {"bs": bs, "draft_tokens": d, "vocab": args.vocab, "chunk_requests": args.chunk_requests}
        try:
            whole = event_us(lambda: fv.fused_verify(logits, None, tree, 1.0, **kw), args.iters)
            state.retire()
            chunked = event_us(lambda: fv.fused_verify(logits, None, tree, 1.0, borrow=state,
                                                       chunk_requests=args.chunk_requests, **kw), args.iters)
            a = fv.fused_verify(logits, None, tree, 1.0, **kw)
            b = fv.fused_verify(logits, None, tree, 1.0, borrow=state, chunk_requests=args.chunk_requests, **kw)
            row.update(unchunked_us=whole, chunked_borrowed_us=chunked, ratio=chunked / whole,
                       agrees=all(torch.equal(x, y) for x, y in zip(a, b)), ok=True)
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        out_rows.append(row)
    state.retire()
    return out_rows


def renorm_row(args):
    rows, vocab = 32, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    probs = torch.softmax(2.0 * torch.randn(rows, vocab, device="cuda", generator=g), dim=-1)
    fused = event_us(lambda: fv.top_p_renorm(probs, 0.9, validate=False), args.iters)
    reference = event_us(lambda: top_p_renorm_probs(probs, 0.9), args.reference_iters, warmup=1)
    same = torch.equal(fv.top_p_renorm(probs, 0.9), top_p_renorm_probs(probs, 0.9))
    goal = 2 * FLASHINFER_TOP_P_US * vocab / FLASHINFER_VOCAB
    record = {"rows": rows, "vocab": vocab, "top_p": 0.9, "fused_us": fused, "reference_us": reference,
              "flashinfer_class_us": FLASHINFER_TOP_P_US * vocab / FLASHINFER_VOCAB, "goal_us": goal,
              "agrees": same,
              "fused_graph_us": graph_us(lambda: fv.top_p_renorm(probs, 0.9, validate=False), args.iters),
              "top_k50_fused_us": event_us(lambda: fv.top_k_renorm(probs, 50, validate=False), args.iters),
              "top_k50_agrees": torch.equal(fv.top_k_renorm(probs, 50), top_k_renorm_probs(probs, 50))}
    record["meets_goal"] = min(fused, record["fused_graph_us"]) <= goal  # device time: eager may wait on the host
    if args.profile:
        record["per_kernel_us"] = kernel_breakdown(lambda: fv.top_p_renorm(probs, 0.9, validate=False))
    return record


def compile_times():
    """Seconds of the first call of each kernel variant (Triton compiles then)."""
    tree, logits, coins, coins_final = make_case(2, 8, 4096, seed=1)
    times = {}
    for name, kw in (("plain", {}), ("top_k+top_p", {"top_ks": 50, "top_ps": 0.9})):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fv.fused_verify(logits, None, tree, 1.0, coins=coins, coins_final=coins_final, **kw)
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t0
    probs = torch.softmax(logits, dim=-1)
    t0 = time.perf_counter()
    fv.top_p_renorm(probs, 0.9)
    torch.cuda.synchronize()
    times["standalone top_p"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fv.fused_token_probs(logits, 1.0, 8, tree.candidates.repeat_interleave(8, dim=0))
    torch.cuda.synchronize()
    times["token probs"] = time.perf_counter() - t0
    return times


def goals_table(rows):
    """Print each point's goals, judged for the step replayed from a CUDA graph and for the
    eager launch separately; returns (replayed, eager) verdicts, one bool per point each."""
    from graphborrow.studies.measured import fused_goals_missed

    print(f"\n{'bs':>4} {'D':>3} {'softmax':>8} {'upstream':>9} {'reference':>10} {'fused':>8} {'graph':>8} "
          f"{'x softmax':>9} {'temp MiB':>9} {'accept':>6} {'agrees':>6}  "
          f"goals (<= upstream, <= 3x softmax, no [bs,V] temporaries): replayed | eager")
    by = {}
    for r in rows:
        by.setdefault((r["bs"], r["draft_tokens"]), {})[r["impl"]] = r
    replayed, eager = [], []
    for (bs, d), impls in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        f, up, ref = impls.get("fused", {}), impls.get("upstream", {}), impls.get("reference", {})
        if not f.get("ok"):
            print(f"{bs:>4} {d:>3}  fused failed: {f.get('error')}")
            replayed.append(False)
            eager.append(False)
            continue
        missed = [fused_goals_missed(us, up.get("device_us"), f["softmax_us"], f["full_vocab_temporaries"])
                  for us in (f["graph_us"], f["device_us"])]
        replayed.append(not missed[0])
        eager.append(not missed[1])
        print(f"{bs:>4} {d:>3} {f['softmax_us']:>8.0f} {up.get('device_us', float('nan')):>9.0f} "
              f"{ref.get('device_us', float('nan')):>10.0f} {f['device_us']:>8.0f} {f['graph_us']:>8.0f} "
              f"{f['graph_us'] / f['softmax_us']:>9.2f} {f['temporary_bytes'] / 2**20:>9.2f} "
              f"{f['accept_length_mean']:>6.2f} {str(f.get('agrees')):>6}  "
              f"{', '.join(missed[0]) or 'met'} | {', '.join(missed[1]) or 'met'}")
    return replayed, eager


def renorm_table(rows):
    print(f"\nwith top_k=50, top_p=0.9:\n{'bs':>4} {'D':>3} {'softmax':>8} {'reference':>10} {'fused':>8} {'graph':>8} "
          f"{'x softmax':>9} {'temp MiB':>9} {'agrees':>6}")
    by = {}
    for r in rows:
        by.setdefault((r["bs"], r["draft_tokens"]), {})[r["impl"]] = r
    for (bs, d), impls in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        f, ref = impls.get("fused_renorm", {}), impls.get("reference_renorm", {})
        if not f.get("ok"):
            print(f"{bs:>4} {d:>3}  fused failed: {f.get('error')}")
            continue
        print(f"{bs:>4} {d:>3} {f['softmax_us']:>8.0f} {ref.get('device_us', float('nan')):>10.0f} "
              f"{f['device_us']:>8.0f} {f['graph_us']:>8.0f} {f['graph_us'] / f['softmax_us']:>9.2f} "
              f"{f['temporary_bytes'] / 2**20:>9.2f} {str(f.get('agrees')):>6}")
    for r in rows:
        if r.get("per_kernel_us"):
            print(f"per kernel, {r['impl']} bs={r['bs']} D={r['draft_tokens']}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["per_kernel_us"].items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON to write (default data/verify_kernels_h200.json; with --only renorm, none)")
    ap.add_argument("--only", choices=("all", "renorm"), default="all",
                    help="renorm: just the standalone top-p / top-k renorm of 32 x V (a quick check of the "
                         "pivot search: time, graph replay time and bitwise agreement)")
    ap.add_argument("--batches", default="1,4,16,32,64,128")
    ap.add_argument("--drafts", default="4,8,16")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reference-iters", type=int, default=3)
    ap.add_argument("--reference-renorm-rows", type=int, default=64,
                    help="run the (slow, sort-based) reference with renorm only up to this many rows")
    ap.add_argument("--chunk-requests", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new points after this long")
    ap.add_argument("--profile", action="store_true", help="device time per kernel at a few points (torch.profiler)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("verify_kernels.py measures CUDA kernels: run it on a GPU machine")
    started = time.monotonic()
    record = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(), "python": platform.python_version()}
    try:
        import triton
        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    if args.only == "renorm":
        return renorm_only(args, record, started)
    record["compile_s"] = compile_times()
    print("Triton compile (first call) seconds:", {k: round(v, 2) for k, v in record["compile_s"].items()})
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
    replayed, eager = goals_table(rows)
    record["goals_met_points"] = sum(replayed)  # replayed from a CUDA graph
    record["goals_met_points_eager"] = sum(eager)
    record["goals_points"] = len(replayed)
    renorm_table(rows)
    for name, fn in (("top_p_renorm", lambda: renorm_row(args)), ("chunked", lambda: chunked_rows(args))):
        try:
            record[name] = fn()
        except Exception as exc:  # noqa: BLE001
            record[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}
    print_renorm(record["top_p_renorm"], args.vocab)
    for r in record["chunked"] if isinstance(record["chunked"], list) else []:
        if r.get("ok"):
            print(f"chunked in borrowed memory bs={r['bs']} D={r['draft_tokens']}: {r['chunked_borrowed_us']:.0f} us vs "
                  f"{r['unchunked_us']:.0f} us ({r['ratio']:.2f}x, goal <= 1.3x: {'met' if r['ratio'] <= 1.3 else 'MISSED'})")
        else:
            print(f"chunked bs={r['bs']} D={r['draft_tokens']} failed: {r.get('error')}")
    write(record, args.out or Path("data/verify_kernels_h200.json"), started)


def renorm_only(args, record, started):
    """--only renorm: the standalone renorm point alone, in the full run's record format."""
    try:
        record["top_p_renorm"] = renorm_row(args)
    except Exception as exc:  # noqa: BLE001
        record["top_p_renorm"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc(limit=4)}
    print_renorm(record["top_p_renorm"], args.vocab)
    if args.out is not None:
        write(record, args.out, started)


def print_renorm(tp, vocab):
    if "fused_us" in tp:
        print(f"\ntop-p renorm 32 x {vocab}: fused {tp['fused_us']:.0f} us (graph {tp['fused_graph_us']:.0f}), "
              f"reference {tp['reference_us']:.0f} us, goal <= {tp['goal_us']:.0f} us: "
              f"{'met' if tp['meets_goal'] else 'MISSED'}; agrees {tp['agrees']}; top-k 50 {tp['top_k50_fused_us']:.0f} us, "
              f"agrees {tp['top_k50_agrees']}; per kernel {tp.get('per_kernel_us')}")
    else:
        print(f"\ntop-p renorm failed: {tp.get('error')}\n{tp.get('traceback', '')}")


def write(record, out, started):
    record["elapsed_s"] = time.monotonic() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out} in {record['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
