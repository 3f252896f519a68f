"""The eager fused step on a real GPU: what one call launches and allocates, the persistent
kernel's work queue at any grid and on two streams, out=, and the capture-once graph path
over either implementation.

Run on a CUDA machine: ``pytest -m gpu tests/eagle/test_eager_launch_gpu.py -rA``. The
oracle for tokens is the reference verification over ``target_probs_reference`` (as in
test_fused_verify_gpu.py); what a call launches is counted by the CUDA profiler, what it
allocates by the caching allocator's own statistics.
"""

import pytest
import torch
from test_fused_verify_gpu import gpu_case, reference
from torch.profiler import ProfilerActivity, profile

from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import BorrowLeakError
from graphborrow.device import get_backend
from graphborrow.eagle import eagle_verify
from graphborrow.eagle.graphs import GRAPH_STEPS, clear_verify_graphs
from graphborrow.eagle.step import VerifyStep
from graphborrow.eagle.triton import launch_config as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/)"),
]

RENORMS = [dict(), dict(top_ks=40, top_ps=0.9)]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def kernels_and_allocations(fn):
    """(kernels launched, blocks allocated) by one call of ``fn`` (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if getattr(e, "device_time_total", 0))
    return kernels, torch.cuda.memory_stats()["allocation.all.allocated"] - allocated


@pytest.mark.parametrize("renorm", RENORMS, ids=["plain", "top-k+top-p"])
def test_one_call_launches_one_kernel_and_allocates_its_outputs(renorm):
    """One kernel (the persistent step) and one allocation (the outputs; the workspace is
    the configuration's, for this stream, made by the first call), parameters as numbers and as
    tensors. With top-k and top-p a step of fewer than SPLIT_ROWS rows is one launch too;
    a larger one is one launch per kind of item: maxima and sums, per search its bracket,
    passes, gather, resolve and kept sums, then the residuals."""
    for bs, d in ((1, 8), (8, 8)):
        tree, logits, coins, coins_final = gpu_case(1, bs, d, (4, 3), 32000, False)
        split = bool(renorm) and bs * d >= lc.SPLIT_ROWS
        for temperature in (0.8, torch.full((bs,), 0.8, device="cuda")):
            kernels, allocations = kernels_and_allocations(
                lambda: eagle_verify(logits, None, tree, temperature, coins=coins, coins_final=coins_final,
                                     impl="fused", validate=False, **renorm))
            assert (kernels, allocations) == ((2 + 2 * 5) if split else 1, 1)


def config_of(logits, tree, temperature, coins, coins_final, renorm):
    return lc.step_config(VerifyStep.of(logits, None, tree, temperature, renorm.get("top_ks"), renorm.get("top_ps"),
                                        coins, coins_final))


def counters_at_zero(config):
    return all(not bool(entry.views.sync.any()) for entry in config.cached.values())


@pytest.mark.parametrize("renorm", RENORMS, ids=["plain", "top-k+top-p"])
def test_eager_calls_reuse_the_workspace_and_give_the_reference_tokens(renorm):
    """From a configuration's second call on (its kernel compiled, its workspace made), the
    eager call reuses the workspace and its cached arguments: the reference's tokens, for
    parameters as numbers and per-request tensors alike; coins not given are drawn into the
    workspace. Every call leaves the workspace's counters at zero. Logits 4 bytes off 16-byte
    alignment are another specialisation of the kernel, and give the same tokens."""
    bs, d, vocab = 16, 8, 50257
    tree, logits, coins, coins_final = gpu_case(6, bs, d, (4, 3), vocab, False, 0.9)
    temps = torch.full((bs,), 0.9, device="cuda")
    params = dict(top_ks=torch.full((bs,), renorm["top_ks"], device="cuda"),
                  top_ps=torch.full((bs,), renorm["top_ps"], device="cuda")) if renorm else {}
    expected = reference(logits, tree, 0.9, renorm.get("top_ks"), renorm.get("top_ps"), coins, coins_final)
    for temperature, kw in ((0.9, renorm), (temps, params)):
        calls = [eagle_verify(logits, None, tree, temperature, coins=coins, coins_final=coins_final, impl="fused",
                              validate=False, **kw) for _ in range(3)]
        assert all(same(got, expected) for got in calls)
        drawn = eagle_verify(logits, None, tree, temperature, impl="fused", validate=False, **kw)
        assert int(drawn.accept_length.min()) >= 1
        torch.cuda.synchronize()
        config = config_of(logits, tree, temperature, coins, coins_final, kw)
        assert len(config.cached) == 1 and counters_at_zero(config)
    shifted = torch.empty(logits.numel() + 1, device="cuda")[1:].view_as(logits).copy_(logits)
    assert shifted.data_ptr() % 16 == 4
    for _ in range(2):
        assert same(eagle_verify(shifted, None, tree, 0.9, coins=coins, coins_final=coins_final, impl="fused",
                                 validate=False, **renorm), expected)


@pytest.mark.parametrize("renorm", RENORMS, ids=["plain", "top-k+top-p"])
def test_any_grid_gives_the_same_tokens_and_leaves_the_counters_at_zero(renorm):
    """The work queue does not depend on how many programs the GPU holds at once: one
    program, a few, the resident grid, and far more programs than fit (the late ones find
    the queue empty) give the reference's tokens, call after call, each leaving every
    counter at zero for the next; and so do many calls in a row on new inputs."""
    bs, d, vocab = 8, 16, 32017
    tree, logits, coins, coins_final = gpu_case(7, bs, d, (4, 5), vocab, False)
    kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False, **renorm)
    eagle_verify(logits, None, tree, 1.0, **kw)
    config = config_of(logits, tree, 1.0, coins, coins_final, renorm)
    resident = list(config.programs)
    expected = reference(logits, tree, 1.0, renorm.get("top_ks"), renorm.get("top_ps"), coins, coins_final)
    try:
        for programs in (1, 5, resident, 50 * max(resident)):
            config.set_programs(programs)
            for _ in range(2):
                assert same(eagle_verify(logits, None, tree, 1.0, **kw), expected), f"{programs} programs"
                torch.cuda.synchronize()
                assert counters_at_zero(config), f"{programs} programs"
    finally:
        config.set_programs(resident)
    results = []
    for seed in range(6):
        _, new_logits, new_coins, new_final = gpu_case(40 + seed, bs, d, (4, 5), vocab, False, tree=tree)
        logits.copy_(new_logits)
        coins.copy_(new_coins)
        coins_final.copy_(new_final)
        results.append((eagle_verify(logits, None, tree, 1.0, **kw),
                        reference(new_logits, tree, 1.0, renorm.get("top_ks"), renorm.get("top_ps"), new_coins,
                                  new_final)))
    assert all(same(got, want) for got, want in results)


def test_two_streams_get_two_workspaces():
    """Calls on two streams at once (one configuration) each use their stream's workspace: both give
    the reference's tokens."""
    bs, d, vocab = 32, 8, 128256
    tree, logits, coins, coins_final = gpu_case(8, bs, d, (4, 3), vocab, False)
    _, other, other_coins, other_final = gpu_case(9, bs, d, (4, 3), vocab, False, tree=tree)
    kw = dict(impl="fused", validate=False)
    expected = [reference(logits, tree, 1.0, None, None, coins, coins_final),
                reference(other, tree, 1.0, None, None, other_coins, other_final)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = [[], []]
    for _ in range(3):
        for i, (s, lg, c, f) in enumerate(zip(streams, (logits, other), (coins, other_coins),
                                              (coins_final, other_final))):
            with torch.cuda.stream(s):
                got[i].append(eagle_verify(lg, None, tree, 1.0, coins=c, coins_final=f, **kw))
    torch.cuda.synchronize()
    assert all(same(out, expected[i]) for i in range(2) for out in got[i])
    config = config_of(logits, tree, 1.0, coins, coins_final, {})
    assert len(config.cached) >= 2 and counters_at_zero(config)


@pytest.mark.parametrize("renorm", RENORMS, ids=["plain", "top-k+top-p"])
def test_the_graph_path_replays_what_an_eager_call_computes(renorm):
    """graph=True: the first call captures (and returns the eager result), later calls with
    the same buffers replay, reading whatever the buffers hold; another buffer address or
    another temperature is another entry; clearing drops them all."""
    clear_verify_graphs()
    bs, d, vocab = 16, 8, 128256
    tree, logits, coins, coins_final = gpu_case(3, bs, d, (4, 3), vocab, False, 0.9)
    kw = dict(impl="fused", validate=False, **renorm)

    def graph_call(lg=logits, temperature=0.9):
        return eagle_verify(lg, None, tree, temperature, coins=coins, coins_final=coins_final, graph=True, **kw)

    assert same(graph_call(), eagle_verify(logits, None, tree, 0.9, coins=coins, coins_final=coins_final, **kw))
    captures = GRAPH_STEPS.captures
    for seed in (31, 32):
        _, new_logits, new_coins, new_final = gpu_case(seed, bs, d, (4, 3), vocab, False, 0.9, tree=tree)
        logits.copy_(new_logits)
        coins.copy_(new_coins)
        coins_final.copy_(new_final)
        replayed = [t.clone() for t in graph_call()]
        expected = reference(new_logits, tree, 0.9, renorm.get("top_ks"), renorm.get("top_ps"), new_coins, new_final)
        assert same(replayed, expected)
    assert GRAPH_STEPS.captures == captures  # replays only
    other = logits.clone()
    assert same(graph_call(other), graph_call())
    graph_call(temperature=1.1)
    assert GRAPH_STEPS.captures == captures + 2 and len(GRAPH_STEPS.entries) == 3
    assert GRAPH_STEPS.held_bytes() == 3 * 4 * (bs * d + bs * tree.tree_depth + bs + lc.sync_words(bs, d))
    clear_verify_graphs()
    assert not GRAPH_STEPS.entries


def test_the_graph_paths_graph_is_the_kernel_alone():
    """An entry keeps its step's counters (zeroed once, left zeroed by every replay), so its
    graph holds the step's kernel and nothing else, where the same step captured by hand
    zeroes its workspace's counters first (a memset node). Two entries replayed in turns, on
    two streams, each give their own logits' tokens and leave their counters at zero."""
    clear_verify_graphs()
    bs, d, vocab = 4, 8, 128256
    tree, logits, coins, coins_final = gpu_case(5, bs, d, (4, 3), vocab, False, 0.9)
    other = gpu_case(6, bs, d, (4, 3), vocab, False, 0.9, tree=tree)[1]
    kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False)
    expected = [reference(lg, tree, 0.9, None, None, coins, coins_final) for lg in (logits, other)]

    def graph_call(lg=logits):
        return eagle_verify(lg, None, tree, 0.9, graph=True, **kw)

    assert kernels_and_allocations(graph_call) == (1, 0)  # (the warm-up call captures)
    by_hand = torch.cuda.CUDAGraph()
    with torch.cuda.graph(by_hand):
        eagle_verify(logits, None, tree, 0.9, **kw)
    assert kernels_and_allocations(by_hand.replay) == (2, 0)
    outs = [graph_call(lg) for lg in (logits, other)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(10):
        for s, lg in zip(streams, (logits, other)):
            s.wait_stream(torch.cuda.current_stream())  # (entries share the pool: one replay at a time)
            with torch.cuda.stream(s):
                graph_call(lg)
            torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert same(outs[0], expected[0]) and same(outs[1], expected[1]) and not same(expected[0], expected[1])
    assert not any(bool(entry.counters.any()) for entry in GRAPH_STEPS.entries.values())
    clear_verify_graphs()


def test_the_graph_path_borrows_from_the_graph_pool():
    """With an enabled borrow the step is captured into the borrow state's graph pool and
    replayed in its replay scope: a borrowed tensor kept alive across it is refused."""
    clear_verify_graphs()
    backend = get_backend("cuda")
    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    x = torch.ones(64 * 2**20 // 4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with state.capture_scope(), backend.graph(g, pool=state.pool_id):
        y = (x * 2)[:8].clone()  # a 64 MiB temporary leaves an idle run in the pool
    tree, logits, coins, coins_final = gpu_case(4, 8, 8, (4, 3), 32000, False)
    kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False)
    expected = eagle_verify(logits, None, tree, 1.0, **kw)
    assert same(eagle_verify(logits, None, tree, 1.0, borrow=state, graph=True, **kw), expected)
    assert same(eagle_verify(logits, None, tree, 1.0, borrow=state, graph=True, **kw), expected)  # a replay
    with state.borrow("a leak"):
        kept = torch.empty(1024, device="cuda")
    with pytest.raises(BorrowLeakError):
        eagle_verify(logits, None, tree, 1.0, borrow=state, graph=True, **kw)
    del kept, y, g
    clear_verify_graphs()
    state.retire()


def test_callers_outputs_are_written_with_nothing_allocated():
    """eagle_verify(out=...) on the eager path: one kernel, no allocation at all, the caller's
    tensors returned holding the reference's tokens (the previous result passed back, as a
    serving loop would, and three tensors of the caller's own)."""
    bs, d = 8, 8
    tree, logits, coins, coins_final = gpu_case(12, bs, d, (4, 3), 128256, False)
    kw = dict(coins=coins, coins_final=coins_final, impl="fused", validate=False)
    expected = reference(logits, tree, 1.0, None, None, coins, coins_final)
    out = eagle_verify(logits, None, tree, 1.0, **kw)
    for t in out:
        t.fill_(-5)
    assert kernels_and_allocations(lambda: eagle_verify(logits, None, tree, 1.0, out=out, **kw)) == (1, 0)
    got = eagle_verify(logits, None, tree, 1.0, out=out, **kw)
    assert all(a is b for a, b in zip(got, out)) and same(got, expected)
    separate = tuple(torch.full_like(t, 3) for t in out)
    assert same(eagle_verify(logits, None, tree, 1.0, out=separate, **kw), expected)


def test_an_entry_that_draws_its_coins_draws_new_ones_each_replay():
    """An entry captured without coins draws them inside its graph from the default CUDA
    generator, and CUDAGraph.replay advances the generator: its replays draw new coins (the
    accept lengths vary), where an entry given coins replays the reference's tokens."""
    clear_verify_graphs()
    bs, d, vocab = 16, 8, 128256
    tree, logits, coins, coins_final = gpu_case(13, bs, d, (4, 3), vocab, False, 0.9)
    expected = reference(logits, tree, 0.9, None, None, coins, coins_final)
    kw = dict(impl="fused", validate=False, graph=True)
    given = [[t.clone() for t in eagle_verify(logits, None, tree, 0.9, coins=coins, coins_final=coins_final, **kw)]
             for _ in range(3)]
    assert all(same(r, expected) for r in given)
    drawn = [[t.clone() for t in eagle_verify(logits, None, tree, 0.9, **kw)] for _ in range(6)]
    assert len(GRAPH_STEPS.entries) == 2 and len({tuple(r[2].tolist()) for r in drawn}) > 1
    clear_verify_graphs()


@pytest.mark.parametrize("mode", ["standard", "lean"])
def test_the_graph_path_replays_the_reference_implementation(mode):
    """graph=True layered on impl="reference": the reference step (pure PyTorch, its
    temporaries in the graph's pool) captured on the first call and replayed after, with new
    logits and coins copied into the same buffers: the reference's tokens each time, and the
    same tokens as the fused kernel's entry for the same buffers."""
    clear_verify_graphs()
    bs, d, vocab = 4, 8, 32000
    tree, logits, coins, coins_final = gpu_case(14, bs, d, (4, 3), vocab, False, 0.9)
    kw = dict(coins=coins, coins_final=coins_final, validate=False, graph=True, top_ks=40, top_ps=0.9)
    for seed in (51, 52, 53):
        _, new_logits, new_coins, new_final = gpu_case(seed, bs, d, (4, 3), vocab, False, 0.9, tree=tree)
        logits.copy_(new_logits)
        coins.copy_(new_coins)
        coins_final.copy_(new_final)
        expected = reference(new_logits, tree, 0.9, 40, 0.9, new_coins, new_final)
        ref = [t.clone() for t in eagle_verify(logits, None, tree, 0.9, impl="reference", mode=mode, **kw)]
        fused = [t.clone() for t in eagle_verify(logits, None, tree, 0.9, impl="fused", **kw)]
        assert same(ref, expected) and same(fused, expected), f"seed {seed}"
    assert GRAPH_STEPS.captures >= 2 and len(GRAPH_STEPS.entries) == 2  # one entry per implementation
    clear_verify_graphs()


def test_graph_true_inside_a_capture_is_refused_by_name():
    """graph=True while the current stream captures a graph is refused with its fix, whether
    the call would capture a new entry or replay an existing one (given its coins or drawing
    them); the same call without graph=True is captured into the caller's graph and replays
    the reference's tokens."""
    bs, d = 4, 8
    tree, logits, coins, coins_final = gpu_case(41, bs, d, (4, 3), 128256, False)
    kw = dict(impl="fused", validate=False)
    expected = reference(logits, tree, 1.0, None, None, coins, coins_final)
    clear_verify_graphs()
    for given in (dict(coins=coins, coins_final=coins_final), {}):
        for entry_exists in (False, True):
            if entry_exists:
                for _ in range(2):  # (captures the entry, then replays it)
                    eagle_verify(logits, None, tree, 1.0, graph=True, **given, **kw)
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(ValueError, match="captures a CUDA graph.*call eagle_verify without graph=True"):
                with torch.cuda.graph(graph):
                    eagle_verify(logits, None, tree, 1.0, graph=True, **given, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = eagle_verify(logits, None, tree, 1.0, coins=coins, coins_final=coins_final, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert same(captured, expected)
    assert same(eagle_verify(logits, None, tree, 1.0, graph=True, coins=coins, coins_final=coins_final, **kw),
                expected)  # the entries still replay outside a capture
    clear_verify_graphs()


def test_the_standalone_renorms_give_the_reference_values_call_after_call():
    """top_k_renorm / top_p_renorm: nine launches through Triton's launcher, the workspace and
    the launches' arguments reused from the second call on: the reference's values at 8 and
    64 rows, for numbers and per-row tensors, call after call."""
    from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs
    from graphborrow.eagle.triton import fused_renorm as fr

    g = torch.Generator(device="cuda").manual_seed(5)
    lc.clear_configs()
    for rows in (8, 64):
        probs = torch.softmax(3.0 * torch.randn(rows, 128256, device="cuda", generator=g), dim=-1)
        ks = torch.tensor([1, 50, 128256, 7] * (rows // 4), device="cuda")
        cases = [(fr.top_p_renorm, 0.9, top_p_renorm_probs(probs, 0.9)),
                 (fr.top_k_renorm, 50, top_k_renorm_probs(probs, 50)),
                 (fr.top_k_renorm, ks, top_k_renorm_probs(probs, ks))]
        for renorm, value, expected in cases:
            got = [renorm(probs, value, validate=False) for _ in range(3)]
            assert all(torch.equal(out, expected) for out in got), (rows, renorm.__name__, value)
    assert all(len(entry.tails) == 9 for config in lc.RENORM_CONFIGS.configs.values()
               for entry in config.cached.values())
