"""eagle_verify: the three modes agree, temporaries live and die inside the borrow scope,
bad input is named, and the fused implementation plugs in."""

import contextlib

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from graphborrow.core.errors import BorrowCapacityError
from graphborrow.eagle import (
    MODES,
    eagle_verify,
    top_k_renorm_probs,
    top_p_renorm_probs,
    tree_speculative_sampling_target_only,
)
from graphborrow.eagle.draft_tree import build_draft_tree, tree_from_parents
from graphborrow.eagle.probs import target_probs

SCOPE = "test-borrow-scope"


class RecordingBorrow:
    """Stands in for the borrow state (a collaborator): records scopes, answers capacity."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.events = []

    @contextlib.contextmanager
    def borrow(self, user):
        self.events.append(("enter", user))
        try:
            with record_function(SCOPE):
                yield
        finally:
            self.events.append(("exit", user))


def allocations(fn):
    """(result, [(time, bytes, ptr, inside_scope)]) from the profiler's CPU allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    found = []

    def walk(nodes, inside):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                f = node.extra_fields
                found.append((node.start_time_ns, f.alloc_size, f.ptr, inside))
            walk(node.children, inside or node.name == SCOPE)

    walk(prof.profiler.kineto_results.experimental_event_tree(), False)
    found.sort()
    return result, found


def scope_peak_and_net(found):
    live = peak = 0
    for _, size, _, inside in found:
        if inside:
            live += size
            peak = max(peak, live)
    return peak, live


def parents_of(tree):
    bs, d = tree.candidates.shape
    parent = torch.full((bs, d), -1, dtype=torch.long)
    for b in range(bs):
        for n in range(d):
            c = int(tree.retrive_next_token[b, n])
            while c != -1:
                parent[b, c] = n
                c = int(tree.retrive_next_sibling[b, c])
    return parent


def make_case(seed, topk=3, depth=3, num_tokens=8, bs=12, vocab=300, boost=5.0, dtype=torch.float32):
    """A tree plus logits that favour the drafted tokens, so that paths get accepted."""
    g = torch.Generator().manual_seed(seed)
    tree = build_draft_tree(topk, depth, num_tokens, bs, vocab, generator=g)
    logits = torch.randn(bs * num_tokens, vocab, generator=g)
    parent = parents_of(tree)
    for b in range(bs):
        for c in range(1, num_tokens):
            logits[b * num_tokens + parent[b, c], tree.candidates[b, c]] += boost * float(torch.rand(1, generator=g))
    return tree, logits.to(dtype), g


def verify(tree, logits, mode, seed=0, **kw):
    return eagle_verify(logits, None, tree, kw.pop("temperatures", 0.9), generator=torch.Generator().manual_seed(seed),
                        mode=mode, **kw)


def assert_same(a, b):
    for x, y, name in zip(a, b, ("predicts", "accept_index", "accept_length")):
        assert torch.equal(x, y), name


SAMPLING = [
    dict(),
    dict(top_ks=20),
    dict(top_ps=0.8),
    dict(top_ks=torch.tensor([1, 5, 300, 2, 50, 7, 3, 1000, 9, 4, 6, 8]), top_ps=torch.linspace(0.2, 1.0, 12)),
    dict(temperatures=torch.linspace(0.3, 1.5, 12), top_ps=torch.full((12,), 0.9)),
    dict(threshold_single=0.6, threshold_acc=0.5, top_ks=4),
]


SHAPES = [(3, 3, 8), (1, 5, 6), (4, 2, 12)]  # (topk, depth, num_draft_tokens)


@pytest.mark.parametrize("case", [(s, i % len(SHAPES)) for i, s in enumerate(range(len(SAMPLING)))] + [(3, 1), (0, 2)])
def test_modes_emit_identical_tokens(case):
    sampling, shape = case
    topk, depth, num_tokens = SHAPES[shape]
    tree, logits, _ = make_case(sampling, topk, depth, num_tokens)
    kw = SAMPLING[sampling]
    standard = verify(tree, logits, "standard", **dict(kw))
    assert standard.accept_length.max() > 1  # drafts do get accepted
    assert_same(standard, verify(tree, logits, "lean", **dict(kw)))
    for rows in (num_tokens, 5 * num_tokens):
        assert_same(standard, verify(tree, logits, "chunked", chunk_rows=rows, **dict(kw)))


def test_modes_agree_for_half_precision_logits_and_a_single_request():
    tree, logits, _ = make_case(1, bs=1, dtype=torch.bfloat16)
    results = [verify(tree, logits, mode, top_ps=0.9) for mode in MODES]
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])


def test_probabilities_do_not_depend_on_how_rows_are_grouped():
    tree, logits, _ = make_case(2)
    bs, d = tree.candidates.shape
    temps = torch.linspace(0.5, 1.2, bs)
    ks, ps = torch.arange(1, bs + 1) * 7, torch.linspace(0.3, 0.95, bs)
    whole = target_probs(logits, temps.repeat_interleave(d), ks.repeat_interleave(d), ps.repeat_interleave(d))
    per_position = logits.view(bs, d, -1)
    for n in range(d):
        part = target_probs(per_position[:, n], temps, ks, ps)
        assert torch.equal(part, whole.view(bs, d, -1)[:, n])
    softmax = torch.softmax(logits.double() / temps.double().repeat_interleave(d)[:, None], -1).float()
    reference = top_p_renorm_probs(top_k_renorm_probs(softmax, ks.repeat_interleave(d)), ps.repeat_interleave(d))
    torch.testing.assert_close(whole, reference, rtol=1e-4, atol=1e-6)


def test_standard_equals_the_kernel_on_hand_computed_probabilities():
    tree, logits, _ = make_case(3)
    bs, d = tree.candidates.shape
    g = torch.Generator().manual_seed(9)
    coins, coins_final = torch.rand(bs, d, generator=g), torch.rand(bs, generator=g)
    got = eagle_verify(logits, tree.candidates, tree, 0.7, top_ks=30, coins=coins, coins_final=coins_final)
    probs = top_k_renorm_probs(torch.softmax(logits / 0.7, dim=-1), 30).view(bs, d, -1)
    predicts = torch.zeros(bs * d, dtype=torch.int32)
    accept_index = torch.full((bs, tree.tree_depth), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    tree_speculative_sampling_target_only(predicts, accept_index, accept_num, tree.candidates, tree.retrive_index,
                                          tree.retrive_next_token, tree.retrive_next_sibling, coins, coins_final,
                                          probs, torch.zeros_like(probs))
    assert torch.equal(got.predicts, predicts)
    assert torch.equal(got.accept_index, accept_index)
    assert torch.equal(got.accept_length, accept_num + 1)


def test_generator_coins_match_explicit_coins():
    tree, logits, _ = make_case(4)
    bs, d = tree.candidates.shape
    g = torch.Generator().manual_seed(5)
    coins, coins_final = torch.rand(bs, d, generator=g), torch.rand(bs, generator=g)
    explicit = eagle_verify(logits, None, tree, 0.9, coins=coins, coins_final=coins_final)
    drawn = eagle_verify(logits, None, tree, 0.9, generator=torch.Generator().manual_seed(5))
    assert_same(explicit, drawn)


def test_hand_built_tree_accepts_a_certain_path():
    tree = tree_from_parents([[-1, 0, 1]], [[0, 4, 2]])
    logits = torch.full((3, 6), -30.0)
    logits[0, 4] = logits[1, 2] = logits[2, 5] = 30.0  # each row is (almost) one-hot on the drafted token
    for mode in MODES:
        r = eagle_verify(logits, None, tree, 1.0, coins=torch.full((1, 3), 0.5), coins_final=torch.tensor([0.5]),
                         mode=mode)
        assert r.accept_length.tolist() == [3]
        assert r.accept_index.tolist() == [[0, 1, 2]]
        assert r.predicts.tolist() == [4, 2, 5]


def test_bonus_row_keeps_tokens_rejected_at_the_last_depth():
    tree = tree_from_parents([[-1, 0, 0]], [[0, 3, 5]])  # S = 2
    logits = torch.full((3, 8), -40.0)
    logits[0, 3] = logits[0, 5] = 0.0  # root: tokens 3 and 5, half each
    logits[2, 3] = logits[2, 7] = 0.0  # after token 5: tokens 3 and 7, half each
    for mode in MODES:
        r = eagle_verify(logits, None, tree, 1.0, coins=torch.tensor([[0.75, 0.0, 0.0]]),
                         coins_final=torch.tensor([0.25]), mode=mode)
        assert r.accept_index.tolist() == [[0, 2]], mode  # token 3 rejected, token 5 accepted
        assert r.predicts.tolist() == [5, 0, 3], mode  # bonus from node 2's row, token 3 included


@pytest.mark.parametrize("mode", MODES)
def test_temporaries_are_born_and_die_inside_the_borrow_scope(mode):
    tree, logits, _ = make_case(5, bs=6)
    state = RecordingBorrow()
    result, found = allocations(lambda: verify(tree, logits, mode, borrow=state, top_ks=10, top_ps=0.9,
                                               chunk_rows=16 if mode == "chunked" else None))
    assert state.events == [("enter", "EAGLE verify"), ("exit", "EAGLE verify")]
    peak, net = scope_peak_and_net(found)
    assert peak > logits.numel() * 4 // 8 and net == 0
    inside = {ptr for _, size, ptr, is_inside in found if is_inside and size > 0}
    outside = {ptr for _, size, ptr, is_inside in found if not is_inside and size > 0}
    for out in result:
        assert out.data_ptr() in outside and out.data_ptr() not in inside  # outputs predate the scope


def test_failed_step_releases_its_temporaries_inside_the_scope(monkeypatch):
    """A fault in the middle of the step (probabilities already allocated): all freed inside."""
    from graphborrow.eagle import modes

    def failing_walk(*args, **kwargs):
        raise RuntimeError("injected fault in the walk")

    monkeypatch.setattr(modes, "walk_tree", failing_walk)
    tree, logits, _ = make_case(6, bs=4)
    state = RecordingBorrow()
    caught = []

    def failing():
        try:
            verify(tree, logits, "standard", borrow=state, top_ks=3)
        except RuntimeError as exc:
            caught.append(exc)  # keeps the traceback alive

    _, found = allocations(failing)
    assert caught and "injected fault" in str(caught[0])
    assert state.events == [("enter", "EAGLE verify"), ("exit", "EAGLE verify")]
    peak, net = scope_peak_and_net(found)
    assert peak > logits.numel() * 4 and net == 0  # the probabilities existed, and died in the scope


def test_disabled_borrow_is_a_no_op():
    tree, logits, _ = make_case(7)
    state = RecordingBorrow(enabled=False)
    assert_same(verify(tree, logits, "standard", borrow=state), verify(tree, logits, "standard"))
    assert state.events == []


def test_bad_arguments_are_named():
    tree, logits, _ = make_case(10, bs=2)
    with pytest.raises(ValueError, match="mode must be one of"):
        verify(tree, logits, "fast")
    with pytest.raises(ValueError, match=r"logits must be \[bs\*D, V\]"):
        verify(tree, logits[:-1], "standard")
    with pytest.raises(ValueError, match="temperatures must be finite and > 0"):
        verify(tree, logits, "standard", temperatures=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="one value per request"):
        verify(tree, logits, "standard", temperatures=torch.ones(3))
    with pytest.raises(ValueError, match="coins must have shape"):
        eagle_verify(logits, None, tree, 1.0, coins=torch.rand(2, 3))
    with pytest.raises(BorrowCapacityError, match="chunk_rows"):
        verify(tree, logits, "chunked", chunk_rows=3)
    with pytest.raises(ValueError, match="threshold_acc"):
        verify(tree, logits, "standard", threshold_acc=2.0)
    with pytest.raises(ValueError, match="candidates must be token ids"):
        eagle_verify(logits, tree.candidates + 1000, tree, 1.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        verify(tree, logits, "standard", impl="triton")


def test_fused_implementation_plugs_in(monkeypatch):
    """impl="fused" runs the Triton kernels (here in Triton's interpreter) once, inside the
    borrow scope, into the outputs made before it, after the checks ran once; "auto" keeps
    CPU tensors on the reference. Both emit the same tokens (the fused tests show why)."""
    from graphborrow.eagle.triton import fused
    from graphborrow.eagle.triton import launch_config

    monkeypatch.setattr(launch_config, "SELECT_CAP", 16)  # the interpreter sorts slowly: a short exact sort
    calls = []
    real = fused.run_step
    state = RecordingBorrow()

    def spy(step, out, launch=True):  # the real kernels run; the spy only notes how they were called
        calls.append((step, out, launch, list(state.events)))
        return real(step, out, launch)

    monkeypatch.setattr(fused, "run_step", spy)
    tree, logits, _ = make_case(11, bs=5)
    expected = verify(tree, logits, "standard", impl="reference", top_ks=7)
    assert_same(verify(tree, logits, "standard", impl="auto", top_ks=7), expected)
    assert calls == []  # auto: CPU tensors take the reference
    got = verify(tree, logits, "standard", impl="fused", top_ks=7, borrow=state)
    assert_same(got, expected)
    (call,) = calls
    step, out, launch, events_then = call
    assert launch is True and events_then == [("enter", "EAGLE verify")]  # inside the scope
    assert all(a is b for a, b in zip(out, got))  # written into the outputs made outside the scope
    assert step.coins is None  # coins drawn from the generator inside the step, in the scope
    assert state.events == [("enter", "EAGLE verify"), ("exit", "EAGLE verify")]


def test_the_fused_path_is_refused_where_it_cannot_run(sim, monkeypatch):
    """One rule chooses the implementation: auto takes the fused kernels on a real CUDA device
    only (so the simulated device, which looks like CUDA, and the CPU keep the reference);
    "fused" on the simulated device, or without triton, is refused by name."""
    from graphborrow.eagle import choose_impl, fused_available
    from graphborrow.eagle import step as step_module
    from graphborrow.eagle.triton import fused
    from graphborrow.eagle.step import real_cuda

    on_sim = torch.zeros(4, 10).to(sim.device)
    assert on_sim.is_cuda and not real_cuda(on_sim)  # the simulated device looks like CUDA to Python code
    assert not real_cuda(torch.zeros(4, 10))
    assert choose_impl("auto", False) == "reference" and choose_impl("fused", False) == "fused"
    assert choose_impl("auto", True) == ("fused" if fused_available() else "reference")
    assert choose_impl("reference", True) == "reference"
    with pytest.raises(ValueError, match="impl must be one of"):
        choose_impl("triton", True)
    tree, logits, _ = make_case(3, bs=2)
    sim_tree = tree._replace(**{f: getattr(tree, f).to(sim.device) for f in tree._fields[:4]})
    with pytest.raises(ValueError, match="simulated device cannot run"):
        eagle_verify(logits.to(sim.device), None, sim_tree, 1.0, impl="fused")
    monkeypatch.setattr(step_module, "fused_available", lambda: False)
    assert choose_impl("auto", True) == "reference"
    monkeypatch.setattr(fused, "TRITON_AVAILABLE", False)
    with pytest.raises(ValueError, match="triton is not installed"):
        verify(tree, logits, "standard", impl="fused")


def test_the_graph_paths_last_call_is_found_only_with_the_same_objects_at_the_same_addresses():
    """The serving loop's shortcut to the previous entry: the very same argument objects, the
    tree holding the same tables, every tensor at the address it was captured with. Anything
    else (another object, a table swapped on the same tree, storage moved in place) misses,
    and the call then builds the full key."""
    from types import SimpleNamespace

    from graphborrow.eagle.graphs import _LastCall

    tree, logits, _ = make_case(3, bs=2)
    coins = torch.rand(2, tree.candidates.shape[1])
    call = (logits, None, tree, 0.9, None, None, coins, None, None, None, 1.0, 1.0, "standard", None, "fused")
    last = _LastCall(call, entry=None)
    assert last.finds(call) and last.finds(tuple(call))
    assert not last.finds((logits.clone(), *call[1:]))  # another tensor object
    assert not last.finds((*call[:3], 1.1, *call[4:]))  # another temperature number
    assert not last.finds((*call[:2], tree._replace(retrive_index=tree.retrive_index.clone()), *call[3:]))
    duck = SimpleNamespace(**tree._asdict())  # a tree the caller may change in place (eagle_verify takes any)
    last = _LastCall((*call[:2], duck, *call[3:]), entry=None)
    duck.retrive_next_token = duck.retrive_next_token.clone()
    assert not last.finds((*call[:2], duck, *call[3:]))
    duck.retrive_next_token = tree.retrive_next_token
    assert last.finds((*call[:2], duck, *call[3:]))
    coins.set_(torch.rand(2, tree.candidates.shape[1]))  # the same object, its storage moved
    assert not last.finds((*call[:2], duck, *call[3:]))


def test_the_graph_path_is_refused_where_it_cannot_run():
    """graph=True replays the step from a CUDA graph: on CPU tensors, whichever the
    implementation, the error names what it needs, and nothing is cached."""
    from graphborrow.eagle.graphs import GRAPH_STEPS

    tree, logits, _ = make_case(3, bs=2)
    for impl in ("auto", "reference", "fused"):
        with pytest.raises(ValueError, match="graph=True replays the step from a CUDA graph: it needs CUDA logits"):
            eagle_verify(logits, None, tree, 1.0, impl=impl, graph=True)
    with pytest.raises(ValueError, match="logits must be"):
        eagle_verify(logits[:-1], None, tree, 1.0, graph=True)
    assert not GRAPH_STEPS.entries
