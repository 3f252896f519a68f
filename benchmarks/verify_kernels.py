"""Fused (Triton) EAGLE verification against upstream's step, eager and replayed; two trees in turns, in one process.

    python benchmarks/verify_kernels.py --baseline ../before --keep-previous-as previous
    python benchmarks/verify_kernels.py --only renorm            # the standalone renorms alone
    python benchmarks/verify_kernels.py --profile --out x.json    # with device time per kernel and a host profile

For every bs in --batches and D in --drafts (V = --vocab, fp32 logits, temperature
--temperature, draft trees as in the upstream measurement: D=4 topk 1 depth 3, D=8 topk 4
depth 3, D=16 topk 4 depth 5; each candidate holds 10-70 % of its parent's row, so paths
are accepted and rejected) it times the public call ``eagle_verify(impl="fused",
validate=False)`` as a serving engine makes it, for this tree's graphborrow (``after``)
and, with ``--baseline TREE``, another tree's (``before``: a checkout or ``git archive`` of
the commit to compare with), point by point in turns on the same inputs:

- ``device_us``: *eager*, CUDA events around the call, one call at a time, the GPU idle
  before it (so the host's launch time counts whenever the GPU waits for it);
  ``host_us``: the call's wall time, the GPU idle before it; ``host_issued_us``: the host's
  time per call of calls issued back to back; ``host_out_us``: the call writing into the
  previous result's tensors (``out=``, nothing allocated);
- ``graph_us``: *replayed*, the same call captured by hand in a CUDA graph; ``graph_path_us``
  / ``graph_path_host_us`` / ``graph_path_pipelined_us``: ``eagle_verify(..., graph=True)``;
- the same with top_k=50, top_p=0.9 (``fused_renorm`` rows: eager and replayed);
- ``agrees``: the tokens equal the reference's (the reference kernel over
  ``target_probs_reference``); the ``upstream`` row's ``upstream_semantics``: the reference's
  tokens against the reference kernel over ``torch.softmax`` probabilities, upstream's step
  (same accept decisions? same tokens?);
- once per point, for both trees: ``softmax_with_temperature_us``, ``torch.softmax(logits /
  T)``, the same-run table's softmax column and the yardstick of "replayed <= 0.6x one
  softmax pass"; ``upstream``: the same-run figures of ../shared/reference/upstream_kernel_h200.md
  (softmax + sgl-kernel eager and replayed; not rebuilt here).

Then the standalone renorms (top-p 0.9, top-k 50 at 8, 32 and 128 rows) eager and
replayed for each tree. Goals per point and tree: eager at or below upstream's eager step,
replayed <= 0.6x softmax(x / T), the reference's tokens. The record goes to --out, by
default ``data/verify_kernels_<device>.json`` (h200, h100, ...), with the printed tables
beside it (``.txt``); a record already there is kept under ``--keep-previous-as NAME``
(``<stem>_NAME.json``), and without that name the run refuses to replace it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import math
import platform
import pstats
import re
import sys
import time
import traceback
from pathlib import Path

import torch
from timing import captured, event_us, host_us, issued_us, pipelined_us
from trees import HERE, Tree

DRAFT_SHAPES = {4: (1, 3), 8: (4, 3), 16: (4, 5)}  # D -> (topk, depth) of the draft tree
# upstream_kernel_h200.md "Same run, both sides": (bs, D) -> (softmax, upstream eager, upstream replayed) us
UPSTREAM_SAME_RUN = {
    (1, 4): (61, 113, 92), (4, 4): (63, 109, 89), (16, 4): (85, 164, 151), (32, 4): (128, 223, 211),
    (64, 4): (213, 333, 319), (128, 4): (409, 559, 546), (1, 8): (61, 122, 100), (4, 8): (54, 114, 105),
    (16, 8): (122, 210, 200), (32, 8): (207, 314, 307), (64, 8): (402, 549, 539), (128, 8): (781, 992, 981),
    (1, 16): (56, 104, 91), (4, 16): (78, 157, 149), (16, 16): (208, 310, 298), (32, 16): (403, 539, 527),
    (64, 16): (781, 982, 973), (128, 16): (1534, 1860, 1846),
}
PROFILE_POINTS = {(1, 4), (1, 8), (16, 8), (128, 16)}
RENORM = {"top_ks": 50, "top_ps": 0.9}
RENORM_ROWS = (8, 32, 128)  # the standalone renorms' row counts
GOALS = {"replayed_vs_softmax": 0.6, "graph_path_vs_manual": 1.1, "renorm_eager_vs_replayed": 1.5}


def make_case(bs, d, vocab, seed, temperature=1.0):
    """Logits whose parent rows give each child ln(V) + 2 nats (the noise's log-mean) plus
    [-2.5, 1], scaled by the temperature: a child then holds 7-73 % of its row, as a
    trained draft's would. Made with the graphborrow importable now."""
    from graphborrow.eagle.draft_tree import build_draft_tree

    topk, depth = DRAFT_SHAPES[d]
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
    from graphborrow.eagle.tree_sampling import tree_speculative_sampling_target_only

    bs, d = tree.candidates.shape
    out = (torch.zeros(bs * d, dtype=torch.int32, device="cuda"),
           torch.full((bs, tree.tree_depth), -1, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, dtype=torch.int32, device="cuda"))
    tree_speculative_sampling_target_only(*out, tree.candidates, tree.retrive_index, tree.retrive_next_token,
                                          tree.retrive_next_sibling, coins, coins_final, probs.view(bs, d, -1),
                                          torch.zeros_like(probs).view(bs, d, -1))
    return out[0], out[1], out[2] + 1


def expected_tokens(logits, tree, coins, coins_final, temperature, renorm):
    """The reference's outputs: the reference kernel over target_probs_reference."""
    from graphborrow.eagle.probs import target_probs_reference

    probs = target_probs_reference(logits, temperature, renorm.get("top_ks"), renorm.get("top_ps"))
    return kernel_over(probs, tree, coins, coins_final)


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
    rows = probs[list(slots)].double()  # slot b * D + node is the node's row
    for b in range(bs):
        if lengths[b] - 1 == tree.tree_depth - 1:
            continue  # every depth accepted: nothing subtracted
        child = next_token[b][slots[b] - b * d]
        while child >= 0:
            rows[b, candidates[b][child]] = 0.0
            child = next_sibling[b][child]
    return rows


def upstream_semantics(logits, tree, coins, coins_final, temperature, got):
    """The fused tokens against upstream's step (the reference kernel over torch.softmax):
    differing accept decisions and tokens, and ``expected_token_flips``: the sum over
    requests of the L1 distance between their residual CDFs under the two sets of
    probabilities (the measure of coins that land between two boundaries that moved)."""
    from graphborrow.eagle.probs import target_probs_reference

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


def host_profile(fn, iters):
    """Where one call's host time goes: kernels and allocations per call, and the Python
    functions it spends its time in (cProfile's own time per call, inflated by the profiler
    but in proportion)."""
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
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:14]
    functions = [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls_per_call": v[1] / iters,
                  "own_us_per_call": v[2] / iters * 1e6} for k, v in top]
    return {"launches_per_call": launches, "allocations_per_call": allocations, "python_functions": functions}


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def fused_rows(tree: Tree, case, expected: list, common: dict, args) -> list:
    """One tree's rows at one point: the plain step and the step with top-k + top-p
    (``expected``: the reference's outputs for each)."""
    api = tree.api
    graph_tree, logits, coins, coins_final = case
    bs, d = common["bs"], common["draft_tokens"]
    t = args.temperature
    rows = []
    for renorm, want in zip(({}, RENORM), expected):
        row = {**common, "tree": tree.label, "impl": "fused_renorm" if renorm else "fused"}
        kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False, **renorm)

        def step():
            return api.eagle_verify(logits, None, graph_tree, t, **kw)

        try:
            got = step()
            row["device_us"] = event_us(step, args.iters)
            graph = captured(step)
            row["graph_us"] = event_us(graph.replay, args.iters)
            del graph
            row["graph_vs_softmax_t"] = row["graph_us"] / common["softmax_with_temperature_us"]
            row["eager_vs_replayed"] = row["device_us"] / row["graph_us"]
            row["agrees"] = not any(differing_requests(want, got, bs, d))
            if not renorm:
                row["host_us"] = host_us(step, args.host_iters)
                row["host_issued_us"] = issued_us(step, args.host_iters)
                row["pipelined_us"] = pipelined_us(step, args.iters)
                out = step()
                into = lambda: api.eagle_verify(logits, None, graph_tree, t, out=out, **kw)  # noqa: E731
                row["host_out_us"] = host_us(into, args.host_iters)
                row["out_agrees"] = same(into(), got)

                def graph_path():
                    return api.eagle_verify(logits, None, graph_tree, t, graph=True, **kw)

                row["graph_path_agrees"] = same(graph_path(), got)  # (the first call captures)
                row["graph_path_us"] = event_us(graph_path, args.iters)
                row["graph_path_host_us"] = host_us(graph_path, args.host_iters)
                row["graph_path_pipelined_us"] = pipelined_us(graph_path, args.iters)
                row["graph_path_agrees"] = row["graph_path_agrees"] and same(graph_path(), got)
                api.clear_graphs()
                if api.workspace_bytes is not None:
                    row["workspace_bytes"] = api.workspace_bytes(bs, d, args.vocab)
            row["ok"] = True
        except Exception as exc:  # noqa: BLE001 (recorded, the sweep goes on)
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=6))
        rows.append(row)
    return rows


def run_point(index: int, bs, d, trees: list, args, rows):
    """Every tree at one point, in turns (which goes first alternates from point to point),
    on the same inputs, against the same reference outputs."""
    vocab, t = args.vocab, args.temperature
    with trees[-1].active():
        case = make_case(bs, d, vocab, seed=bs * 100 + d, temperature=t)
        graph_tree, logits, coins, coins_final = case
        expected = [expected_tokens(logits, graph_tree, coins, coins_final, t, renorm) for renorm in ({}, RENORM)]
        semantics = upstream_semantics(logits, graph_tree, coins, coins_final, t, expected[0])
    common = {"bs": bs, "draft_tokens": d, "vocab": vocab, "temperature": t,
              "softmax_with_temperature_us": event_us(lambda: torch.softmax(logits / t, dim=-1), args.iters)}
    up = UPSTREAM_SAME_RUN.get((bs, d))
    rows.append({**common, "impl": "upstream", "upstream_semantics": semantics,
                 **({"device_us": float(up[1]), "graph_us": float(up[2]), "softmax_us_upstream_run": float(up[0]),
                     "source": "shared/reference/upstream_kernel_h200.md, same run, both sides"}
                    if up and vocab == 128256 else {})})
    for tree in (trees if index % 2 == 0 else trees[::-1]):
        with tree.active():
            rows.extend(fused_rows(tree, case, expected, common, args))


def standalone_renorm_rows(tree: Tree, args) -> list:
    """Each standalone renorm eager and replayed at ``RENORM_ROWS`` rows, for one tree."""
    from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs

    out = []
    for rows in RENORM_ROWS:
        g = torch.Generator(device="cuda").manual_seed(rows)
        probs = torch.softmax(2.0 * torch.randn(rows, args.vocab, device="cuda", generator=g), dim=-1)
        for name, fn, value, reference in (("top_p", tree.api.top_p_renorm, 0.9, top_p_renorm_probs),
                                           ("top_k", tree.api.top_k_renorm, 50, top_k_renorm_probs)):
            def call(fn=fn, value=value):
                return fn(probs, value, validate=False)

            row = {"tree": tree.label, "renorm": name, "rows": rows, "vocab": args.vocab, "value": value}
            try:
                row["agrees"] = torch.equal(call(), reference(probs, value))
                row["device_us"] = event_us(call, args.iters)
                row["host_us"] = host_us(call, args.iters)
                row["graph_us"] = event_us(captured(call).replay, args.iters)
                row["eager_vs_replayed"] = row["device_us"] / row["graph_us"]
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            out.append(row)
    return out


def host_floor(args):
    """Host time of the pieces any eager step is made of, on this machine: one CUDA
    allocation, one torch kernel launch, one CUDA graph replay."""
    x = torch.zeros(1024, device="cuda")
    graph = captured(lambda: x.add_(1))
    return {"torch_empty_us": host_us(lambda: torch.empty(1024, device="cuda"), args.iters * 10),
            "torch_add_us": host_us(lambda: x.add_(1), args.iters * 10),
            "graph_replay_us": host_us(graph.replay, args.iters * 10)}


def profile_rows(tree: Tree, args) -> list:
    """Per-kernel device time and the host profile of one tree's eager call at PROFILE_POINTS
    (last: once torch.profiler has started, every later launch in the process is slower)."""
    out = []
    for bs, d in sorted(PROFILE_POINTS):
        graph_tree, logits, coins, coins_final = make_case(bs, d, args.vocab, seed=bs * 100 + d,
                                                           temperature=args.temperature)
        for renorm in ({}, RENORM):
            kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False, **renorm)

            def step():
                return tree.api.eagle_verify(logits, None, graph_tree, args.temperature, **kw)

            record = {"tree": tree.label, "bs": bs, "draft_tokens": d, "renorm": bool(renorm)}
            try:
                record["per_kernel_us"] = kernel_breakdown(step)[0]
                record.update(host_profile(step, args.iters * 5))
            except Exception as exc:  # noqa: BLE001
                record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            out.append(record)
    return out


def goals(rows):
    """The goals per point and tree: (bs, D, tree) -> verdicts."""
    upstream = {(r["bs"], r["draft_tokens"]): r for r in rows if r["impl"] == "upstream"}
    verdicts = {}
    for f in rows:
        if f["impl"] != "fused":
            continue
        key = (f["bs"], f["draft_tokens"], f["tree"])
        if not f.get("ok"):
            verdicts[key] = {"ok": False, "error": f.get("error")}
            continue
        up = upstream.get(key[:2], {})
        renorm = next((r for r in rows if r["impl"] == "fused_renorm" and r.get("ok")
                       and (r["bs"], r["draft_tokens"], r["tree"]) == key), {})
        verdicts[key] = {
            "ok": True,
            "eager_le_upstream_eager": "device_us" in up and f["device_us"] <= up["device_us"],
            "replayed_le_0.6_softmax": f["graph_vs_softmax_t"] <= GOALS["replayed_vs_softmax"],
            "same_tokens_as_reference": bool(f.get("agrees")),
            "graph_path_le_1.1_manual": f["graph_path_us"] <= GOALS["graph_path_vs_manual"] * f["graph_us"],
            "renorm_eager_le_1.5_replayed": (renorm.get("eager_vs_replayed", math.inf)
                                             <= GOALS["renorm_eager_vs_replayed"]),
            "renorm_same_tokens_as_reference": bool(renorm.get("agrees")),
        }
    return verdicts


def print_tables(rows, verdicts, say):
    labels = sorted({r["tree"] for r in rows if "tree" in r}, key=lambda x: x != "before")
    points = sorted({(r["bs"], r["draft_tokens"]) for r in rows}, key=lambda p: (p[1], p[0]))
    find = {(r["bs"], r["draft_tokens"], r.get("tree"), r["impl"]): r for r in rows}
    say(f"\n{'bs':>4} {'D':>3} {'smax/T':>7} {'up eager':>8} {'up repl':>7} | " + " | ".join(
        f"{label}: {'eager':>6} {'host':>5} {'issued':>6} {'out=':>5} {'replay':>6} {'x smT':>5} {'gpath':>6} "
        f"{'g host':>6} {'rn eager':>8} {'rn repl':>7} ok" for label in labels) + " | goals missed")
    for bs, d in points:
        up = find.get((bs, d, None, "upstream"), {})
        cells, missed = [], []
        smax = math.nan
        for label in labels:
            f = find.get((bs, d, label, "fused"), {})
            fr = find.get((bs, d, label, "fused_renorm"), {})
            smax = f.get("softmax_with_temperature_us", smax)
            g = lambda k, r=f: r.get(k, math.nan)  # noqa: E731
            cells.append(f"{label}: {g('device_us'):>6.0f} {g('host_us'):>5.0f} {g('host_issued_us'):>6.0f} "
                         f"{g('host_out_us'):>5.0f} {g('graph_us'):>6.0f} {g('graph_vs_softmax_t'):>5.2f} "
                         f"{g('graph_path_us'):>6.0f} {g('graph_path_host_us'):>6.1f} "
                         f"{fr.get('device_us', math.nan):>8.0f} {fr.get('graph_us', math.nan):>7.0f} "
                         f"{'y' if f.get('agrees') and fr.get('agrees') else 'N'}")
            missed += [f"{label} {k}" for k, ok in verdicts.get((bs, d, label), {}).items() if ok is False]
        say(f"{bs:>4} {d:>3} {smax:>7.0f} {up.get('device_us', math.nan):>8.0f} {up.get('graph_us', math.nan):>7.0f} | "
            + " | ".join(cells) + " | " + (", ".join(missed) or "-"))


def device_tag() -> str:
    """A short name of this GPU for the record's file name: h200, h100, or the name's letters."""
    name = torch.cuda.get_device_name().lower()
    found = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    return found.group(1) if found else re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def keep_previous(out: Path, name: str | None) -> Path | None:
    """Move a record already at ``out`` (and its ``.txt``) aside as ``<stem>_<name>``; refuse without a name."""
    if not out.exists():
        return None
    if not name:
        raise SystemExit(f"{out} exists: pass --keep-previous-as NAME to keep it as {out.stem}_NAME{out.suffix}, "
                         "or --out another file")
    kept = out.with_name(f"{out.stem}_{name}{out.suffix}")
    if kept.exists():
        raise SystemExit(f"{kept} exists too: choose another --keep-previous-as")
    out.rename(kept)
    if out.with_suffix(".txt").exists():
        out.with_suffix(".txt").rename(kept.with_suffix(".txt"))
    return kept


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON to write (default data/verify_kernels_<device>.json; with --only renorm, none)")
    ap.add_argument("--keep-previous-as", default=None,
                    help="keep a record already at --out as <stem>_NAME.json (and its .txt)")
    ap.add_argument("--only", choices=("all", "renorm"), default="all")
    ap.add_argument("--package", type=Path, default=HERE, help="the tree measured as 'after' (default: this one)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a tree measured as 'before', in turns with --package, in this process")
    ap.add_argument("--batches", default="1,4,16,32,64,128")
    ap.add_argument("--drafts", default="4,8,16")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--temperature", type=float, default=0.7, help="the same-run table's (0.7)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--host-iters", type=int, default=100,
                    help="calls per host-time median (host time jitters far more than GPU time)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="stop starting new points after this long")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time and the host profile, last")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("verify_kernels.py measures CUDA kernels: run it on a GPU machine")
    started = time.monotonic()
    out = args.out or (Path("data") / f"verify_kernels_{device_tag()}.json" if args.only == "all" else None)
    if out is not None and out.exists() and not args.keep_previous_as:
        keep_previous(out, None)  # (refuses before anything is measured)
    given = argv if argv is not None else sys.argv[1:]
    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    import triton

    trees = ([Tree("before", args.baseline)] if args.baseline else []) + [Tree("after", args.package)]
    record = {"command": " ".join(["python benchmarks/verify_kernels.py", *given]), "torch": torch.__version__,
              "triton": triton.__version__, "device": torch.cuda.get_device_name(),
              "python": platform.python_version(), "trees": {t.label: str(t.root) for t in trees}}
    for tree in trees:  # anything a tree builds on first use, built before anything is timed
        if tree.api.compiled_eager_path is not None:
            with tree.active():
                record.setdefault("compiled_eager_path", {})[tree.label] = tree.api.compiled_eager_path() is not None
    record["host_floor"] = host_floor(args)
    say(f"{record['device']}, torch {record['torch']}, triton {record['triton']}; trees {record['trees']}")
    say("host floor: " + json.dumps({k: round(v, 1) for k, v in record["host_floor"].items()}))
    if args.only == "all":
        rows = []
        drafts, batches = [int(x) for x in args.drafts.split(",")], [int(x) for x in args.batches.split(",")]
        for index, (bs, d) in enumerate((bs, d) for d in drafts for bs in batches):
            if time.monotonic() - started > args.budget_s:
                rows.append({"bs": bs, "draft_tokens": d, "vocab": args.vocab, "impl": "skipped",
                             "error": "time budget spent"})
                continue
            try:
                run_point(index, bs, d, trees, args, rows)
            except Exception as exc:  # noqa: BLE001
                rows.append({"bs": bs, "draft_tokens": d, "vocab": args.vocab, "impl": "failed",
                             "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)})
            torch.cuda.empty_cache()
            print(f"  bs={bs} D={d} done at {time.monotonic() - started:.0f}s", flush=True)
        record["rows"] = rows
        verdicts = goals(rows)
        print_tables(rows, verdicts, say)
        record["goals"] = {f"{bs}x{d} {label}": v for (bs, d, label), v in verdicts.items()}
        for tree in trees:
            mine = [v for (_, _, label), v in verdicts.items() if label == tree.label]
            met = {name: sum(1 for v in mine if v.get(name)) for name in (mine[0] if mine else {}) if name != "ok"}
            record.setdefault("goals_met_points", {})[tree.label] = met
            say(f"goals met ({tree.label}, of {len(mine)} points): {met}")
    record["standalone_renorm"] = []
    for tree in trees:
        with tree.active():
            record["standalone_renorm"] += standalone_renorm_rows(tree, args)
    say("\nstandalone renorms: tree, renorm, rows: eager / replayed us (ratio), host us, same values")
    for r in record["standalone_renorm"]:
        say(f"  {r['tree']:<6} {r['renorm']} {r['rows']:>4}: {r.get('device_us', math.nan):.0f} / "
            f"{r.get('graph_us', math.nan):.0f} ({r.get('eager_vs_replayed', math.nan):.2f}), "
            f"{r.get('host_us', math.nan):.0f}, {r.get('agrees')}")
    if args.profile:
        with trees[-1].active():
            record["profile"] = profile_rows(trees[-1], args)
        for r in record["profile"]:
            say(f"profile {r['tree']} {r['bs']} x {r['draft_tokens']} renorm {r['renorm']}: "
                f"{r.get('launches_per_call')} launches, {r.get('allocations_per_call')} allocations; "
                + ", ".join(f"{f['function']} {f['own_us_per_call']:.1f}" for f in r.get("python_functions", [])[:5]))
    record["elapsed_s"] = time.monotonic() - started
    if out is not None:
        kept = keep_previous(out, args.keep_previous_as)
        if kept is not None:
            record["previous_record"] = str(kept)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1))
        with contextlib.suppress(OSError):
            out.with_suffix(".txt").write_text(f"# {record['command']}\n" + "\n".join(lines) + "\n")
        print(f"\nwrote {out} in {record['elapsed_s']:.0f} s"
              + (f" (the previous record kept as {kept})" if kept else ""))
    return record


if __name__ == "__main__":
    main()
