"""eagle_verify on a device (the simulated one always, a real GPU when marked ``gpu``),
borrowing from a captured graph ladder: same tokens as on CPU, no device growth."""

import pytest
import torch

from graphborrow.eagle import MODES, eagle_verify
from graphborrow.eagle.draft_tree import build_draft_tree

MiB = 1 << 20
BS, D, VOCAB = 6, 8, 4000


def cpu_case():
    g = torch.Generator().manual_seed(0)
    tree = build_draft_tree(3, 3, D, BS, VOCAB, generator=g)
    logits = torch.randn(BS * D, VOCAB, generator=g)
    for b in range(BS):  # favour the root's children in the root row so paths get accepted
        c = int(tree.retrive_next_token[b, 0])
        while c != -1:
            logits[b * D, tree.candidates[b, c]] += 8
            c = int(tree.retrive_next_sibling[b, c])
    return tree, logits, torch.rand(BS, D, generator=g), torch.rand(BS, generator=g)


def on(backend, t):
    return t.to(backend.device)


def device_drop(backend, step):
    """Device bytes the step made the allocator take (segments stay cached until empty_cache)."""
    backend.synchronize()
    backend.empty_cache()
    free0, _ = backend.mem_get_info()
    result = step()
    backend.synchronize()
    free1, _ = backend.mem_get_info()
    return result, free0 - free1


@pytest.mark.parametrize("mode", MODES)
def test_device_matches_cpu_and_borrowing_takes_no_device_memory(backend, ladder, mode):
    tree, logits, coins, coins_final = cpu_case()
    kw = dict(top_ks=40, top_ps=0.9, coins=coins, coins_final=coins_final, mode=mode, impl="reference")
    expected = eagle_verify(logits, None, tree, 0.8, **kw)
    assert expected.accept_length.max() > 1
    dev_tree = tree._replace(**{f: on(backend, getattr(tree, f)) for f in tree._fields[:4]})
    dev_logits = on(backend, logits)
    kw.update(coins=on(backend, coins), coins_final=on(backend, coins_final))

    plain, plain_drop = device_drop(backend, lambda: eagle_verify(dev_logits, None, dev_tree, 0.8, **kw))
    state = ladder.state
    assert state.enabled and state.largest_run() > 8 * BS * D * VOCAB
    borrowed, borrowed_drop = device_drop(
        backend, lambda: eagle_verify(dev_logits, None, dev_tree, 0.8, borrow=state, **kw))

    for got in (plain, borrowed):
        for x, y in zip(got, expected):
            assert torch.equal(x.cpu(), y)
    assert state.live_borrowed_bytes() == 0  # every temporary died inside the scope
    ladder.replay(0)  # and a replay after the borrow is allowed
    assert borrowed_drop <= 2 * MiB  # the outputs' small-pool segment at most
    if mode == "standard":
        assert plain_drop >= 8 * BS * D * VOCAB  # probabilities + draft scratch, without borrowing


@pytest.mark.parametrize("backend", ["sim"], indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_temporaries_appear_in_the_borrow_pool_and_are_gone_after_the_step(backend, ladder, mode):
    """The allocator's own trace: every block the step took in the borrow pool was freed in it."""
    tree, logits, coins, coins_final = cpu_case()
    dev_tree = tree._replace(**{f: on(backend, getattr(tree, f)) for f in tree._fields[:4]})
    kw = dict(top_ks=40, top_ps=0.9, coins=on(backend, coins), coins_final=on(backend, coins_final), mode=mode)
    dev_logits, state = on(backend, logits), ladder.state
    backend.record_memory_history(max_entries=100_000)
    result = eagle_verify(dev_logits, None, dev_tree, 0.8, borrow=state, **kw)
    trace = backend.full_snapshot()["device_traces"][0]
    backend.record_memory_history(False)
    pool = backend.memory_snapshot(backend.pool_id(state.mem_pool))
    spans = [(s["address"], s["address"] + s["total_size"]) for s in pool]

    def in_pool(entry):
        return any(a <= entry["addr"] < b for a, b in spans)

    taken = [e for e in trace if e["action"] == "alloc" and in_pool(e)]
    released = [e for e in trace if e["action"] == "free_completed" and in_pool(e)]
    assert sum(e["size"] for e in taken) >= BS * D * VOCAB * 4  # at least one probability matrix's worth
    assert sorted(e["addr"] for e in taken) == sorted(e["addr"] for e in released)
    assert all(b["state"] == "inactive" for s in pool for b in s["blocks"])
    assert all(any(r <= e["addr"] < r + n for r, n in state.free_runs()) for e in taken)
    assert result.accept_length.min() >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda"], indirect=True)
def test_fused_path_on_the_gpu_borrows_and_emits_the_reference_tokens(backend, ladder):
    """impl="auto" on CUDA is the fused kernels: the CPU reference's tokens (the same formula),
    a workspace of a few KiB that lives and dies in the borrow pool, no device growth."""
    from graphborrow.eagle import choose_impl
    from graphborrow.eagle.step import real_cuda

    tree, logits, coins, coins_final = cpu_case()
    expected = eagle_verify(logits, None, tree, 0.8, top_ks=40, top_ps=0.9, coins=coins, coins_final=coins_final,
                            impl="reference")
    dev_tree = tree._replace(**{f: on(backend, getattr(tree, f)) for f in tree._fields[:4]})
    dev_logits = on(backend, logits)
    assert choose_impl("auto", real_cuda(dev_logits)) == "fused"
    kw = dict(top_ks=40, top_ps=0.9, coins=on(backend, coins), coins_final=on(backend, coins_final))
    eagle_verify(dev_logits, None, dev_tree, 0.8, **kw)  # compiles and loads the kernels (driver memory) first
    state = ladder.state
    borrowed, borrowed_drop = device_drop(backend, lambda: eagle_verify(dev_logits, None, dev_tree, 0.8, borrow=state,
                                                                        **kw))
    for x, y in zip(borrowed, expected):
        assert torch.equal(x.cpu(), y)
    assert state.live_borrowed_bytes() == 0
    ladder.replay(0)
    assert borrowed_drop <= 2 * MiB  # the outputs' small-pool segment at most
