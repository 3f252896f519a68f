"""Values where code reads them: small tensors keep real values on the layout-only device."""

import pytest
import torch

from graphborrow.sim import SimBackend, SimLayoutOnlyError
from graphborrow.sim.cuda_api import simulated_cuda
from graphborrow.sim.values import FLOAT_VALUES_LIMIT, INT_VALUES_LIMIT


@pytest.fixture
def layout():
    backend = SimBackend(backed=False)
    yield backend
    backend.close()


def test_small_integer_and_bool_tensors_keep_values(layout):
    positions = torch.arange(8, device="cuda").expand(4, 8)
    diff = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    assert ((diff != 1).cumsum(-1)[:, -1] == 0).all()  # transformers' packed-sequence check
    assert positions.sum().item() == 4 * 28 and positions.tolist()[1] == list(range(8))
    assert torch.tensor([3, 1, 2], device="cuda").sort().values.tolist() == [1, 2, 3]
    mask = torch.ones(64, 1032, dtype=torch.bool, device="cuda")
    assert not mask.sim_inner.is_meta and bool(mask.all())


def test_large_floating_tensors_stay_shape_only_and_say_where_a_value_was_asked(layout):
    logits = torch.zeros(8, 128256, device="cuda")
    assert logits.sim_inner.is_meta
    top = logits.argmax(-1)  # made from shape-only data: shape-only too
    with pytest.raises(SimLayoutOnlyError, match=r"test_sim_values\.py:\d+ in test_large") as error:
        top[0].item()
    assert "argmax" in str(error.value)
    with pytest.raises(SimLayoutOnlyError, match="copying a tensor to the host"):
        logits.cpu()
    assert "layout_only=True" in repr(logits)


def test_the_thresholds_decide_what_keeps_values(layout):
    ints = torch.zeros(INT_VALUES_LIMIT // 8, dtype=torch.int64, device="cuda")
    too_many = torch.zeros(INT_VALUES_LIMIT // 8 + 1, dtype=torch.int64, device="cuda")
    floats = torch.zeros(FLOAT_VALUES_LIMIT // 4, device="cuda")
    too_big = torch.zeros(FLOAT_VALUES_LIMIT // 4 + 1, device="cuda")
    assert [t.sim_inner.is_meta for t in (ints, too_many, floats, too_big)] == [False, True, False, True]
    assert torch.empty(4, dtype=torch.int64, device="cuda").sim_inner.is_meta  # no defined values to keep


def test_writing_shape_only_data_into_a_tensor_with_values_loses_them(layout):
    ids = torch.zeros(16, dtype=torch.int64, device="cuda")
    view = ids[:4]
    big = torch.zeros(4096, 4096, device="cuda").argmax(-1)  # shape-only int64
    ids.copy_(big[:16])
    with pytest.raises(SimLayoutOnlyError, match="aten.copy_"):
        view.tolist()


def test_a_plain_transformers_forward_runs_without_positions_or_masks():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512, num_hidden_layers=2)
    backend = SimBackend(backed=False, activate=False)
    try:
        with simulated_cuda(backend):
            with torch.device("cuda"):
                model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
            ids = torch.randint(0, 512, (2, 7), device="cuda")
            with torch.inference_mode():
                logits = model(input_ids=ids).logits
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    captured = model(input_ids=ids, use_cache=False).logits
            assert logits.shape == captured.shape == (2, 7, 512) and logits.dtype == torch.bfloat16
            assert torch.cuda.memory_snapshot(g.pool())
    finally:
        backend.close()
