"""The verification step allocates by shape alone, so the planner's recording is the step's.

Each case runs eagle_verify on a simulated device with real values (trees of different
depths, parameters as numbers or tensors, coins given or drawn, renorms on or off) and
records what the step allocates inside its borrow scope; that must equal, request for
request, the sequence the planner composes from phases recorded on a layout-only device.
"""

import contextlib

import pytest
import torch

from graphborrow.eagle import StepShape, eagle_verify
from graphborrow.eagle.draft_tree import build_draft_tree, tree_from_parents
from graphborrow.eagle.sequence import verify_sequence
from graphborrow.planning.planner import ALLOC, Recording
from graphborrow.sim import SimBackend


class PhaseBorrow:
    """A borrow state whose scope records the allocator's requests (a collaborator of the test)."""

    enabled = True

    def __init__(self, backend):
        self.recording = Recording(backend)
        self.events = None

    @contextlib.contextmanager
    def borrow(self, user):
        with self.recording.phase() as events:
            yield
        self.events = events


def normalised(events):
    """Sizes in order, frees as the ordinal of the allocation they release."""
    order, out, count = {}, [], 0
    for kind, ident, nbytes, _ in events:
        if kind == ALLOC:
            order[ident] = count  # a repeated group reuses its ids once they are freed
            count += 1
            out.append(("alloc", nbytes))
        else:
            out.append(("free", order[ident]))
    return out


@pytest.fixture
def device():
    backend = SimBackend(capacity=2**31, blas_workspace=0)
    yield backend
    backend.close()


def case(device, bs, d, vocab, chain, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if chain:  # one path: accept width S = D
        tree = tree_from_parents([list(range(-1, d - 1))] * bs, torch.randint(vocab, (bs, d), generator=g).tolist())
    else:
        tree = build_draft_tree(2, 2, d, bs, vocab, generator=g)
    logits = (3 * torch.randn(bs * d, vocab, generator=g)).to(dtype)
    on = tree._replace(**{f: getattr(tree, f).to("cuda") for f in tree._fields[:4]})
    return on, logits.to("cuda"), g


@pytest.mark.parametrize("mode,per_chunk", [("standard", None), ("lean", None), ("chunked", 3)])
@pytest.mark.parametrize("variant", range(4))
def test_the_step_allocates_what_the_planner_recorded(device, mode, per_chunk, variant):
    bs, d, vocab = 7, 5, 3000
    top_k, top_p = variant in (1, 3), variant in (2, 3)
    tree, logits, g = case(device, bs, d, vocab, chain=variant % 2 == 0, seed=variant)
    kw = {}
    if variant == 0:  # numbers, coins drawn from a generator
        kw.update(temperatures=0.8, generator=torch.Generator().manual_seed(1))
    elif variant == 1:  # tensors, coins given
        kw.update(temperatures=torch.linspace(0.5, 1.5, bs), coins=torch.rand(bs, d, generator=g).to("cuda"),
                  coins_final=torch.rand(bs, generator=g).to("cuda"))
    else:
        kw.update(temperatures=torch.tensor(0.9))
    if top_k:
        kw["top_ks"] = 40 if variant == 1 else torch.arange(1, bs + 1) * 300
    if top_p:
        kw["top_ps"] = torch.linspace(0.2, 1.0, bs) if variant == 2 else 0.9
    borrow = PhaseBorrow(device)
    chunk_rows = per_chunk * d if per_chunk else None
    eagle_verify(logits, None, tree, borrow=borrow, mode=mode, chunk_rows=chunk_rows, **kw)
    planned = verify_sequence(StepShape(bs, d, vocab, top_k, top_p), mode, per_chunk)
    assert normalised(borrow.events) == normalised(planned.events)


def test_half_precision_logits_have_their_own_sequence(device):
    bs, d, vocab = 3, 4, 1000
    tree, logits, _ = case(device, bs, d, vocab, chain=False, seed=9, dtype=torch.bfloat16)
    borrow = PhaseBorrow(device)
    eagle_verify(logits, None, tree, 0.7, borrow=borrow, mode="lean")
    bf16 = verify_sequence(StepShape(bs, d, vocab, False, False, torch.bfloat16), "lean")
    fp32 = verify_sequence(StepShape(bs, d, vocab, False, False, torch.float32), "lean")
    assert normalised(borrow.events) == normalised(bf16.events) != normalised(fp32.events)


def test_lean_holds_far_less_than_standard():
    for bs, d in ((32, 8), (128, 16)):
        shape = StepShape(bs, d, 128256, False, False)
        standard = verify_sequence(shape, "standard").peak_bytes
        lean = verify_sequence(shape, "lean").peak_bytes
        assert standard >= 8 * bs * d * 128256  # target probabilities + draft scratch (as upstream)
        assert lean < standard / (d / 4)


def test_chunked_sequence_is_the_groups_in_order():
    shape = StepShape(10, 4, 5000, True, False)
    whole = verify_sequence(shape, "standard")
    assert verify_sequence(shape, "chunked", 10).events == whole.events
    groups = verify_sequence(shape, "chunked", 4)  # 4 + 4 + 2 requests
    assert groups.peak_bytes < whole.peak_bytes
    assert groups.allocations > whole.allocations
    with pytest.raises(ValueError, match="per_chunk must be in"):
        verify_sequence(shape, "chunked", 11)
