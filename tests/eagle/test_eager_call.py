"""The compiled eager short path (graphborrow/eagle/triton/eager_call.cpp): built here against
this torch, taking exactly the calls eager.short_path() takes and declining the rest.

On the CPU a route has device -1 and no stream; its launch is a recorder standing in for the
kernel (whose launches run on a GPU: test_eager_launch_gpu.py checks the routed calls there
against the Python short path and Triton's launcher). What is checked here is the Router
itself: the checks, the arguments it hands the launch, the outputs it cuts, the coins it draws.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphborrow.eagle.draft_tree import build_draft_tree
from graphborrow.eagle.modes import VerifyResult
from graphborrow.eagle.step import draw_into
from graphborrow.eagle.triton import direct, eager_call
from graphborrow.eagle.triton.eager import EAGER_CALL_ARGS
from graphborrow.eagle.triton.step_kernel import ABSENT, NUMBER, ONE_VALUE, PER_REQUEST

BS, D, V, STEPS = 3, 4, 1000, 4
WORDS, AT_INDEX, AT_LENGTH = 32, 12, 24  # outputs: predicts [12] at 0, accept_index [3, 4] at 12, accept_length at 24
TUNABLES = (1, 2, 3)
# the verification kernel's per-call kinds: 13 addresses, t (f32), k (i32), p (f32), the two thresholds (f32)
PER_CALL_KINDS = "P" * 13 + "fiff" + "f"


@pytest.fixture(scope="module")
def compiled():
    module = eager_call.module()
    assert module is not None, "the compiled eager path did not build: " + repr(eager_call.build())
    return module


class Recorder:
    """The launch of a route: keeps what it is called with."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class Case:
    """One call's arguments on the CPU, a router with one route for them, and its recorder."""

    def __init__(self, compiled, forms=(NUMBER, ABSENT, ABSENT), dtypes=(None, None, None), hooks=False,
                 head=(), tail=(), depth=None):
        g = torch.Generator().manual_seed(0)
        self.tree = build_draft_tree(2, 2, D, BS, V, generator=g)
        self.logits = torch.randn(BS * D, V, generator=g)
        self.coins = torch.rand(BS, D, generator=g)
        self.coins_final = torch.rand(BS, generator=g)
        self.workspace = torch.zeros(64)
        self.coins_view, self.coins_final_view = self.workspace[:BS * D].view(BS, D), self.workspace[32:32 + BS]
        self.defaults = (1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20)
        self.tunables, self.hooked = TUNABLES, hooks
        self.router = compiled.Router(lambda: self.tunables, lambda: self.hooked, draw_into, VerifyResult)
        self.launch = Recorder()
        self.router.add(BS, D, V, depth or self.tree.tree_depth, -1, torch.float32, forms, dtypes, 0, self.defaults,
                        self.coins_view, self.coins_final_view, STEPS, WORDS, AT_INDEX, AT_LENGTH,
                        [(self.launch, head, tail)], TUNABLES, self)

    def call(self, temperatures=0.7, top_ks=None, top_ps=None, coins="given", coins_final="given", generator=None,
             ts=1.0, ta=1.0, out=None, logits=None, candidates=None, tree=None):
        coins = self.coins if coins == "given" else coins
        coins_final = self.coins_final if coins_final == "given" else coins_final
        return self.router.call(self.logits if logits is None else logits, candidates,
                                self.tree if tree is None else tree, temperatures, top_ks, top_ps, coins, coins_final,
                                generator, ts, ta, out)


def addresses(tree, logits):
    return [logits.data_ptr(), tree.candidates.data_ptr(), tree.retrive_index.data_ptr(),
            tree.retrive_next_token.data_ptr(), tree.retrive_next_sibling.data_ptr()]


def test_a_routed_call_hands_the_launch_the_callers_addresses_and_numbers(compiled):
    """fused._step_args' order: the five inputs, the three outputs, coins, coins_final,
    temperature / top-k / top-p (the workspace's slot for a number), then the numbers and
    the thresholds (threshold_acc at least 1e-9)."""
    case = Case(compiled)
    result = case.call(temperatures=0.7, ts=0.25, ta=0.0)
    assert isinstance(result, VerifyResult) and len(case.launch.calls) == 1
    args = case.launch.calls[0]
    assert len(args) == EAGER_CALL_ARGS
    outputs = [t.data_ptr() for t in result]
    assert list(args[:13]) == addresses(case.tree, case.logits) + outputs + [
        case.coins.data_ptr(), case.coins_final.data_ptr(), *case.defaults[2:]]
    assert args[13:] == (0.7, 0, 0.0, 0.25, 1e-9)
    assert direct.module() is not None
    direct.module().KernelLaunch(0, 0, (1, 1, 1), 128, 0, 0, PER_CALL_KINDS, ()).pack(*args)  # the kernel's kinds


def test_the_outputs_are_cut_from_one_int32_buffer(compiled):
    """predicts [bs*D], accept_index [bs, S], accept_length [bs], int32 and contiguous, at the
    route's word offsets of one allocation, none of them a view (as unsafe_split_with_sizes)."""
    case = Case(compiled)
    predicts, accept_index, accept_length = case.call()
    assert [t.shape for t in (predicts, accept_index, accept_length)] == [(BS * D,), (BS, STEPS), (BS,)]
    assert all(t.dtype == torch.int32 and t.is_contiguous() and t._base is None
               for t in (predicts, accept_index, accept_length))
    storage = predicts.untyped_storage()
    assert storage.nbytes() == 4 * WORDS
    assert accept_index.untyped_storage().data_ptr() == accept_length.untyped_storage().data_ptr() == storage.data_ptr()
    assert (accept_index.data_ptr() - predicts.data_ptr(), accept_length.data_ptr() - predicts.data_ptr()) == (
        4 * AT_INDEX, 4 * AT_LENGTH)
    accept_length.fill_(7)
    assert torch.equal(torch.tensor(storage.tolist()[4 * AT_LENGTH:4 * AT_LENGTH + 4], dtype=torch.uint8),
                       torch.tensor([7, 0, 0, 0], dtype=torch.uint8))
    second = case.call()
    assert second.predicts.data_ptr() != predicts.data_ptr()  # a new allocation per call


def test_parameters_as_tensors_are_read_in_place(compiled):
    """Per-request tensors (one value per request, or a 0-d tensor: ONE_VALUE) hand their own
    addresses, and the numbers' places hold zeros."""
    t = torch.full((BS,), 0.9)
    k = torch.tensor(5, dtype=torch.int64)
    p = torch.full((BS,), 0.8, dtype=torch.float64)
    case = Case(compiled, forms=(PER_REQUEST, ONE_VALUE, PER_REQUEST), dtypes=(torch.float32, torch.int64,
                                                                                 torch.float64))
    assert case.call(temperatures=t, top_ks=k, top_ps=p) is not None
    args = case.launch.calls[0]
    assert list(args[10:13]) == [t.data_ptr(), k.data_ptr(), p.data_ptr()] and args[13:16] == (0.0, 0, 0.0)
    assert case.call(temperatures=t, top_ks=k, top_ps=p.float()) is None  # another dtype: another plan


@pytest.mark.parametrize("top_ks,expected", [(50, 50), (50.0, 50), (2**40, 2**31 - 1), (float(2**40), 2**31 - 1)])
def test_top_k_numbers_are_read_as_int32(compiled, top_ks, expected):
    case = Case(compiled, forms=(NUMBER, NUMBER, NUMBER))
    assert case.call(top_ks=top_ks, top_ps=0.9) is not None
    assert case.launch.calls[0][13:16] == (0.7, expected, 0.9)


def test_coins_not_given_are_drawn_into_the_workspace(compiled):
    """From the generator, into the route's views, whose workspace addresses the launch gets."""
    case = Case(compiled)
    g = torch.Generator().manual_seed(3)
    assert case.call(coins=None, coins_final=None, generator=g) is not None
    g = torch.Generator().manual_seed(3)
    assert torch.equal(case.coins_view, torch.rand(BS, D, generator=g))
    assert torch.equal(case.coins_final_view, torch.rand(BS, generator=g))
    assert case.launch.calls[0][8:10] == case.defaults[:2]


def test_the_callers_outputs_are_written_and_returned(compiled):
    """out=: its three addresses, and out itself when it is a VerifyResult (a tuple becomes one)."""
    case = Case(compiled)
    out = VerifyResult(torch.zeros(BS * D, dtype=torch.int32), torch.zeros(BS, STEPS, dtype=torch.int32),
                       torch.zeros(BS, dtype=torch.int32))
    assert case.call(out=out) is out
    as_tuple = case.call(out=tuple(out))
    assert type(as_tuple) is VerifyResult and all(a is b for a, b in zip(as_tuple, out))
    assert case.call(out=list(out)) is not None
    assert [c[5:8] for c in case.launch.calls] == [tuple(t.data_ptr() for t in out)] * 3


def test_leading_and_trailing_arguments_go_around_the_per_call_ones(compiled):
    """Triton's C launcher's form: grid, stream and handles before, the workspace's after."""
    case = Case(compiled, head=(528, 1, 1, 0), tail=("w", 7))
    case.call()
    args = case.launch.calls[0]
    assert args[:4] == (528, 1, 1, 0) and args[-2:] == ("w", 7) and len(args) == 4 + EAGER_CALL_ARGS + 2


def _misaligned():
    flat = torch.randn(BS * D * V + 1)
    return flat[1:].view(BS * D, V)  # contiguous, 4 bytes past a 16-byte boundary


def _other_tree(**change):
    tree = build_draft_tree(2, 2, D, BS, V, generator=torch.Generator().manual_seed(0))
    return tree._replace(**change)


class _Tree:  # the fields of a tree without tree_depth
    def __init__(self, tree):
        self.candidates, self.retrive_index = tree.candidates, tree.retrive_index
        self.retrive_next_token, self.retrive_next_sibling = tree.retrive_next_token, tree.retrive_next_sibling


DECLINED = {
    "logits a subclass": dict(logits=torch.nn.Parameter(torch.randn(BS * D, V), requires_grad=False)),
    "logits not contiguous": dict(logits=torch.randn(V, BS * D).t()),
    "logits float64": dict(logits=torch.randn(BS * D, V, dtype=torch.float64)),
    "logits rows not bs * D": dict(logits=torch.randn(BS * D + 1, V)),
    "logits of another vocabulary": dict(logits=torch.randn(BS * D, V + 1)),
    "logits sparse": dict(logits=torch.randn(BS * D, V).to_sparse()),
    "logits misaligned": dict(logits=_misaligned()),
    "candidates int32": dict(candidates=torch.zeros(BS, D, dtype=torch.int32)),
    "candidates 1-d": dict(candidates=torch.zeros(BS * D, dtype=torch.int64)),
    "retrive_index of another shape": dict(tree=_other_tree(retrive_index=torch.zeros(BS, D + 1,
                                                                                       dtype=torch.int64))),
    "retrive_next_token int32": dict(tree=_other_tree(retrive_next_token=torch.zeros(BS, D, dtype=torch.int32))),
    "tree_depth of another plan": dict(tree=_other_tree(tree_depth=5)),
    "tree_depth 0": dict(tree=_other_tree(tree_depth=0)),
    "tree_depth not an int": dict(tree=_other_tree(tree_depth=3.0)),
    "a tree without tree_depth": dict(tree=_Tree(_other_tree())),
    "coins float64": dict(coins=torch.rand(BS, D, dtype=torch.float64)),
    "coins of another shape": dict(coins=torch.rand(BS * D)),
    "coins_final of another shape": dict(coins_final=torch.rand(BS, 1)),
    "coins_final not contiguous": dict(coins_final=torch.rand(BS, 2)[:, 0]),
    "threshold a bool": dict(ts=True),
    "threshold above 1": dict(ta=1.5),
    "threshold NaN": dict(ts=math.nan),
    "threshold a tensor": dict(ts=torch.tensor(0.5)),
    "temperature a bool": dict(temperatures=True),
    "temperature a string": dict(temperatures="0.7"),
    "temperature tensor of another length": dict(temperatures=torch.full((BS + 1,), 0.7)),
    "temperature tensor (another form)": dict(temperatures=torch.full((BS,), 0.7)),
    "top-k given (another form)": dict(top_ks=40),
    "top-p given (another form)": dict(top_ps=0.9),
    "out of two tensors": dict(out=(torch.zeros(BS * D, dtype=torch.int32), torch.zeros(BS, dtype=torch.int32))),
    "out int64": dict(out=(torch.zeros(BS * D, dtype=torch.int64), torch.zeros(BS, STEPS, dtype=torch.int32),
                           torch.zeros(BS, dtype=torch.int32))),
    "out of another shape": dict(out=(torch.zeros(BS * D, dtype=torch.int32), torch.zeros(BS, STEPS + 1,
                                                                                           dtype=torch.int32),
                                      torch.zeros(BS, dtype=torch.int32))),
    "out a generator": dict(out=iter(())),
}


@pytest.mark.parametrize("change", DECLINED.values(), ids=DECLINED.keys())
def test_what_eager_would_not_take_the_same_way_is_declined(compiled, change):
    """None (short_path() then takes the call, or the general path names the problem) and nothing
    launched, drawn or allocated."""
    case = Case(compiled)
    before = case.workspace.clone()
    assert case.call(**change) is None
    assert case.launch.calls == [] and torch.equal(case.workspace, before)


def test_top_k_as_float_must_be_whole(compiled):
    case = Case(compiled, forms=(NUMBER, NUMBER, ABSENT))
    assert case.call(top_ks=2.5) is None and case.call(top_ks=math.inf) is None
    assert case.call(top_ks=torch.full((BS,), 5.0)) is None  # a float tensor for an integer parameter
    assert case.launch.calls == []


def test_other_tunables_or_a_launch_hook_decline(compiled):
    """The plan was made for other module sizes (a test shrank them), or a profiler's launch
    hook is installed (every launch then takes Triton's front end, which calls it)."""
    case = Case(compiled)
    case.tunables = (1, 2, 4)
    assert case.call() is None
    case.tunables, case.hooked = TUNABLES, True
    assert case.call() is None
    case.hooked = False
    assert case.call() is not None and len(case.launch.calls) == 1


def test_routes_are_replaced_by_key_and_cleared(compiled):
    case = Case(compiled)
    assert len(case.router) == 1
    again = Recorder()
    case.router.add(BS, D, V, case.tree.tree_depth, -1, torch.float32, (NUMBER, ABSENT, ABSENT), (None,) * 3, 0,
                    case.defaults, case.coins_view, case.coins_final_view, STEPS, WORDS, AT_INDEX, AT_LENGTH,
                    [(again, (), ())], TUNABLES, None)
    assert len(case.router) == 1
    case.call()
    assert case.launch.calls == [] and len(again.calls) == 1
    case.router.add(BS, D, V, case.tree.tree_depth, -1, torch.float16, (NUMBER, ABSENT, ABSENT), (None,) * 3, 0,
                    case.defaults, case.coins_view, case.coins_final_view, STEPS, WORDS, AT_INDEX, AT_LENGTH,
                    [], TUNABLES, None)
    assert len(case.router) == 2
    case.router.clear()
    assert len(case.router) == 0 and case.call() is None


def test_a_launch_that_raises_propagates(compiled):
    case = Case(compiled)

    def failing(*args):
        raise RuntimeError("cuLaunchKernel failed")

    case.router.add(BS, D, V, case.tree.tree_depth, -1, torch.float32, (NUMBER, ABSENT, ABSENT), (None,) * 3, 0,
                    case.defaults, case.coins_view, case.coins_final_view, STEPS, WORDS, AT_INDEX, AT_LENGTH,
                    [(failing, (), ())], TUNABLES, None)
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed"):
        case.call()


@pytest.mark.parametrize("bad,message", [
    (dict(forms=(1, 0)), "forms and dtypes must be 3-tuples"),
    (dict(launches=[("not a triple",)]), "each launch must be"),
    (dict(dtype="float32"), "expected a torch.dtype"),
])
def test_a_malformed_route_is_refused(compiled, bad, message):
    router = compiled.Router(lambda: TUNABLES, lambda: False, draw_into, VerifyResult)
    args = dict(forms=(NUMBER, ABSENT, ABSENT), launches=[], dtype=torch.float32) | bad
    view = torch.zeros(4)
    with pytest.raises(TypeError, match=message):
        router.add(BS, D, V, 3, -1, args["dtype"], args["forms"], (None,) * 3, 0, (0,) * 5, view, view, STEPS,
                   WORDS, AT_INDEX, AT_LENGTH, args["launches"], TUNABLES, None)
    assert len(router) == 0


def test_a_failed_build_says_why_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """A compiler that fails: the error names the command (torch's headers as system headers,
    torch's libraries) and nothing half-built is left to be loaded."""
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="building the compiled eager path failed") as failed:
        eager_call.build()
    assert "-isystem" in str(failed.value) and "-ltorch_python" in str(failed.value)
    assert [p for p in tmp_path.iterdir() if not p.name.startswith(".")] == [] and not any(
        p.suffix == ".so" for p in tmp_path.rglob("*"))


def test_the_build_command_makes_both_launchers(compiled):
    """``python -m graphborrow build --launchers``: the direct launcher and the compiled eager
    path, each found built (make setup-test built them) or built now."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "graphborrow", "build", "--launchers"], cwd=repo,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"direct launcher: {direct.build().name}" in done.stdout
    assert f"compiled eager path: {eager_call.build().name}" in done.stdout


def test_a_call_keeps_its_route_while_routes_change_under_it(compiled):
    """A launch calls back into Python, where another thread may clear the router or add
    routes: the call goes on with the route it found (its second launch is still made, with
    the same arguments), and the route's objects live until the call ends."""
    case = Case(compiled)
    second, other = Recorder(), Recorder()

    def first(*args):
        case.router.clear()
        for depth in range(10, 48):  # (routes enough to reuse freed memory; none of this tree's depth)
            case.router.add(BS, D, V, depth, -1, torch.float32, (NUMBER, ABSENT, ABSENT), (None,) * 3, 0,
                            case.defaults, torch.zeros(BS, D), torch.zeros(BS), STEPS, WORDS, AT_INDEX, AT_LENGTH,
                            [(other, (), ()), (other, (), ())], TUNABLES, None)
        case.launch(*args)

    views = torch.zeros(BS, D), torch.zeros(BS)  # (held by the route alone once the test lets go of them)
    case.router.clear()
    case.router.add(BS, D, V, case.tree.tree_depth, -1, torch.float32, (NUMBER, ABSENT, ABSENT), (None,) * 3, 0,
                    case.defaults, *views, STEPS, WORDS, AT_INDEX, AT_LENGTH, [(first, (), ()), (second, (), ())],
                    TUNABLES, None)
    del views
    result = case.call(coins=None, coins_final=None)
    assert isinstance(result, VerifyResult) and len(case.router) == 38
    assert case.launch.calls == second.calls and len(second.calls) == 1 and other.calls == []
    assert case.call() is None  # (its route is gone now)


def test_the_router_keeps_as_many_routes_as_the_plan_cache(compiled):
    """At most 256 routes (fused.STEP_PLANS keeps as many plans): the oldest goes first."""
    case = Case(compiled)
    for depth in range(10, 10 + 256):
        case.router.add(BS, D, V, depth, -1, torch.float32, (NUMBER, ABSENT, ABSENT), (None,) * 3, 0, case.defaults,
                        case.coins_view, case.coins_final_view, STEPS, WORDS, AT_INDEX, AT_LENGTH, [], TUNABLES, None)
    assert len(case.router) == 256
    assert case.call() is None  # the first route, the case's own, went first
    assert case.call(tree=_other_tree(tree_depth=10 + 255)) is not None and case.launch.calls == []


def test_a_router_that_was_not_initialised_says_so(compiled):
    router = compiled.Router.__new__(compiled.Router)
    for use in (lambda: router.call(*[None] * 12), router.clear, lambda: len(router)):
        with pytest.raises(RuntimeError, match="was not initialised"):
            use()
