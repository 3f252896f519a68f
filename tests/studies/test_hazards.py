"""The borrowing hazards of notebook 08, on the simulated device."""

import pytest
import torch

from graphborrow.device import get_backend
from graphborrow.studies import hazards
from graphborrow.workloads.ladder import GraphLadder, ModelShape

MB = 2**20


def _ladder(backend, prefill_tokens, intermediate=1024):
    shape = ModelShape(hidden=256, intermediate=intermediate, layers=1, vocab=2048, dtype=torch.float32)
    return GraphLadder(backend, shape, prefill_tokens=prefill_tokens, decode_batches=[8, 4, 2, 1],
                       draft_tokens=4).capture()


@pytest.fixture
def big_runs():
    """A ladder whose largest idle run holds the simulated 32 MiB cuBLAS workspace."""
    backend = get_backend("sim", backed=False)
    ladder = _ladder(backend, prefill_tokens=4096, intermediate=4096)
    assert ladder.state.largest_run() >= 40 * MB
    yield ladder
    backend.close()


@pytest.fixture
def small_runs():
    backend = get_backend("sim")
    ladder = _ladder(backend, prefill_tokens=256)
    assert ladder.state.largest_run() < backend.blas_workspace
    yield ladder
    backend.close()


def test_a_workspace_made_inside_the_borrow_stays_in_the_pool_and_blocks_replay(big_runs):
    report = hazards.library_workspace_hazard(big_runs)
    assert report.step_error is None
    assert report.left_in_pool_bytes == big_runs.backend.blas_workspace
    assert report.inside_runs_bytes == report.left_in_pool_bytes, "the workspace sits in the idle runs"
    assert report.guard_message and "still referenced" in report.guard_message
    # released again: the next borrow and replay work
    assert big_runs.state.live_borrowed_bytes() == 0
    big_runs.prefill()


def test_a_workspace_larger_than_every_run_turns_a_fitting_step_into_oom(small_runs):
    report = hazards.library_workspace_hazard(small_runs)
    assert report.step_error and report.step_error.split(":")[0].endswith("OutOfMemoryError")  # torch's, or a subclass
    assert report.left_in_pool_bytes == 0 and report.guard_message is None


@pytest.mark.parametrize("ladder_name", ["big_runs", "small_runs"])
def test_rehearsal_outside_the_borrow_removes_the_hazard(request, ladder_name):
    ladder = request.getfixturevalue(ladder_name)
    report = hazards.library_workspace_hazard(ladder, rehearse=True)
    assert report.step_error is None
    assert report.left_in_pool_bytes == 0
    assert report.guard_message is None


def test_a_kept_mask_is_caught_by_the_guard_and_overwritten_without_it(small_runs):
    report = hazards.escaped_tensor_hazard(small_runs, lambda logits: torch.full_like(logits, 3.0), batch=8)
    mask_bytes = 8 * 4 * 2048 * 4
    assert report.left_in_pool_bytes >= mask_bytes
    assert report.inside_runs_bytes == report.left_in_pool_bytes
    assert report.guard_message and f"{report.left_in_pool_bytes} bytes" in report.guard_message
    assert report.overwritten_fraction is not None and 0.0 <= report.overwritten_fraction <= 1.0
    small_runs.prefill()  # the kept tensor is gone: guarded replay works again


def test_a_kept_tensor_of_no_values_has_no_overwritten_share(small_runs):
    report = hazards.escaped_tensor_hazard(small_runs, lambda logits: logits[:0] > 0, batch=8)
    assert report.overwritten_fraction is None  # not 0.0 and not NaN: no value could change


def test_peak_step_bytes_follows_the_allocator():
    backend = get_backend("sim", backed=False)
    try:
        def step():
            a = torch.empty(3 * MB, dtype=torch.uint8, device="cuda")  # 3 MiB block
            b = torch.empty(1000, dtype=torch.uint8, device="cuda")  # rounded to 1024
            del a
            c = torch.empty(MB, dtype=torch.uint8, device="cuda")
            return b, c

        assert hazards.peak_step_bytes(step, backend) == 3 * MB + 1024
    finally:
        backend.close()
