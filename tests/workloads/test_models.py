"""Real transformers model code captured into one pool, on the simulated device.

The values check runs the same weights through transformers on the plain CPU (its own
attention kernels, its own cache) and compares the logits a replayed simulated graph
produced: layouts, the CUDA attention model and capture/replay all have to be right for
them to agree.
"""

import pytest
import torch
import transformers

from graphborrow.core.errors import ParameterError
from graphborrow.core.runs import summarize
from graphborrow.sim import SimBackend
from graphborrow.workloads.ladder import GraphLadder, build_ladder, model_names
from graphborrow.workloads.models import MODELS, ModelLadder, model_config

pytestmark = pytest.mark.slow


@pytest.fixture
def backed():
    b = SimBackend(backed=True)
    yield b
    b.close()


@pytest.fixture
def layout():
    b = SimBackend(backed=False)
    yield b
    b.close()


def test_configs_have_the_published_widths():
    llama = model_config("llama-3-8b", layers=3)
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.vocab_size, llama.num_hidden_layers) == (4096, 14336, 32, 8, 128256, 3)
    qwen = model_config("qwen2.5-7b")
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.vocab_size) == (3584, 18944, 28, 4, 152064)
    mistral = model_config("mistral-7b")
    assert (mistral.vocab_size, mistral.sliding_window) == (32768, None)
    mixtral = model_config("mixtral-8x7b")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.vocab_size) == (8, 2, 32000)
    qmoe = model_config("qwen3-30b-a3b")
    assert (qmoe.num_experts, qmoe.num_experts_per_tok, qmoe.moe_intermediate_size) == (128, 8, 768)
    for name in MODELS:
        c = model_config(name)
        assert c._attn_implementation == "sdpa"
        assert isinstance(c, transformers.PretrainedConfig)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_class_is_the_one_transformers_builds(name):
    # the class is imported before the device block (so imports make no device tensors): it must be the one used
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config(name, layers=1, tiny=True))
    assert type(model).__name__ == MODELS[name].model_class


def test_tiny_keeps_the_architecture():
    tiny = model_config("mixtral-8x7b", tiny=True)
    assert type(tiny) is transformers.MixtralConfig
    assert tiny.hidden_size == 64 and tiny.num_local_experts == 4
    assert tiny.num_attention_heads != tiny.num_key_value_heads  # grouped-query attention kept


@pytest.mark.parametrize("bad, match", [
    (dict(model="gpt-5"), "unknown model 'gpt-5'"),
    (dict(layers=0), "layers must be a positive integer"),
    (dict(decode_batches=()), "decode_batches"),
    (dict(prefill="chunked"), "prefill must be one of"),
    (dict(context=-1), "context"),
])
def test_bad_parameters_are_named(layout, bad, match):
    kwargs = dict(model="llama-3-8b", tiny=True)
    kwargs.update(bad)
    with pytest.raises(ParameterError, match=match):
        ModelLadder(layout, **kwargs)


def _reference_logits(ladder, ids, batch):
    """The same weights and inputs through transformers on the plain CPU."""
    config = ladder.config
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=ladder.dtype)
    ref.load_state_dict({k: v.cpu() for k, v in ladder.model.state_dict().items()})
    ref.eval()
    cache = transformers.StaticCache(config=config, max_cache_len=ladder.cache_len)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch, config.num_key_value_heads, head_dim, ladder.dtype, torch.device("cpu"))
    for layer in cache.layers:
        layer.cumulative_length.fill_(ladder.context)
    inputs = {k: v.cpu() for k, v in ladder.inputs[("verify", batch)].items()}
    inputs["input_ids"] = ids
    with torch.inference_mode():
        return ref(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=0).logits


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replayed_verify_graph_computes_the_models_logits(backed, name):
    ladder = ModelLadder(backed, name, layers=2, decode_batches=(2, 1), draft_tokens=3, context=5,
                         dtype=torch.float32, tiny=True).capture()
    ids = torch.randint(0, ladder.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(1))
    ladder.inputs[("verify", 2)]["input_ids"].copy_(ids.to("cuda"))  # a new step's tokens, as an engine writes them
    got = ladder.decode(2).cpu()
    expected = _reference_logits(ladder, ids, 2)
    assert got.shape == (2, 3, ladder.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.abs().sum() > 0


def test_layout_only_device_leaves_the_same_pool_as_a_backed_one(backed, layout):
    from graphborrow.fidelity.compare import compare_snapshots

    kwargs = dict(layers=2, decode_batches=(4, 2, 1), draft_tokens=4, context=40, prefill="graph",
                  prefill_tokens=48, tiny=True)
    backed.activate()  # device="cuda" means the device active on this thread
    a = ModelLadder(backed, "qwen3-30b-a3b", **kwargs).capture().snapshot()
    layout.activate()
    b = ModelLadder(layout, "qwen3-30b-a3b", **kwargs).capture().snapshot()
    assert a and len(a) == len(b)
    result = compare_snapshots(a, b)
    assert result.identical, result.summary()


def test_full_widths_capture_largest_first_into_one_pool(layout):
    ladder = ModelLadder(layout, "llama-3-8b", layers=2, decode_batches=(1, 8, 4), draft_tokens=8,
                         context=512).capture()
    assert ladder.decode_batches == [8, 4, 1]
    assert sorted(k[1] for k in ladder.graphs) == [1, 4, 8]
    segments = ladder.snapshot()
    pools = {tuple(s["segment_pool_id"]) for s in segments}
    assert pools == {tuple(ladder.pool_id)}
    # the bs=8 graph's logits stay alive in the pool: 8 requests x 8 tokens x 128256 bf16
    logits_bytes = 8 * 8 * 128256 * 2
    active = [b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    assert max(active) >= logits_bytes
    # repeat_kv's expanded keys for bs=8 (8 x 32 heads x 520 positions x 128 x bf16) were temporaries
    summary = summarize(segments)
    assert summary["inactive_bytes"] >= 8 * 32 * 520 * 128 * 2


def test_prefill_graph_adds_its_activations_to_the_pool(layout):
    def pool(prefill):
        b = SimBackend(backed=False)
        try:
            lad = ModelLadder(b, "llama-3-8b", layers=1, decode_batches=(2, 1), context=1024,
                              prefill=prefill).capture()
            assert lad.cache_len == 1024 + 8 and lad.prefill_tokens == (0 if prefill == "none" else 1024)
            return summarize(lad.snapshot())
        finally:
            b.close()

    none, graph, pieces = pool("none"), pool("graph"), pool("piecewise")
    assert graph["reserved_bytes"] > none["reserved_bytes"]
    assert graph["inactive_bytes"] > none["inactive_bytes"]
    assert pieces["reserved_bytes"] > none["reserved_bytes"]


def test_mixture_of_experts_routes_through_grouped_gemm(layout):
    from graphborrow.sim.tensor import CUDA_MODELS

    assert torch.ops.aten.histc.default in CUDA_MODELS  # CUDA's int histogram, which grouped_mm routing uses
    ladder = ModelLadder(layout, "mixtral-8x7b", layers=1, decode_batches=(2,), context=64).capture()
    assert ladder.model.config._experts_implementation == "grouped_mm"
    assert ("verify", 2) in ladder.graphs


def test_build_ladder_offers_synthetic_and_every_model(backed, layout):
    assert model_names()[0] == "synthetic" and set(model_names()[1:]) == set(MODELS)
    syn = build_ladder("synthetic", layout, prefill_tokens=0, decode_batches=(2, 1), layers=1)
    assert isinstance(syn, GraphLadder) and syn.shape.layers == 1 and syn.prefill_tokens == 0
    real = build_ladder("mistral-7b", backed, decode_batches=(1,), context=8)
    assert isinstance(real, ModelLadder) and real.tiny  # a backed device gets tiny widths by default
    assert build_ladder("mistral-7b", layout, decode_batches=(1,)).tiny is False
    with pytest.raises(ParameterError, match="choose one of"):
        build_ladder("gpt-5", layout)
    with pytest.raises(ParameterError, match="synthetic workload only"):
        build_ladder("llama-3-8b", layout, shape=syn.shape)


def test_decode_pads_up_and_refuses_too_large_batches(layout):
    ladder = ModelLadder(layout, "llama-3-8b", layers=1, decode_batches=(4, 2), context=16, tiny=True).capture()
    assert ladder.graph_batch(3) == 4
    assert ladder.decode(3).shape[0] == 3
    with pytest.raises(ParameterError, match="exceeds the largest captured batch 4"):
        ladder.decode(5)


def _blocks(segments):
    return [(s["total_size"], [(b["size"], b["state"]) for b in s["blocks"]]) for s in segments]


def test_a_configuration_object_captures_the_same_pool_as_its_name(layout):
    """The reader's own configuration goes the same way as a named one: the layer count and
    attention are set on a copy (the original keeps its 5 layers), and the pool is identical."""
    kw = dict(decode_batches=(8, 2), draft_tokens=4, context=256, layers=1)
    named = build_ladder("qwen2.5-7b", layout, **kw).capture()
    config = model_config("qwen2.5-7b", layers=5)
    other = SimBackend(backed=False)
    try:
        mine = build_ladder(config, other, **kw).capture()
        assert config.num_hidden_layers == 5 and mine.config.num_hidden_layers == 1
        assert mine.name == "qwen2" and _blocks(mine.snapshot()) == _blocks(named.snapshot())
    finally:
        other.close()


@pytest.mark.parametrize("config", [
    transformers.GemmaConfig(hidden_size=2048, intermediate_size=16384, num_attention_heads=8,
                             num_key_value_heads=1, head_dim=256, vocab_size=256000),
    transformers.Phi3Config(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                            num_key_value_heads=32, vocab_size=32064),
], ids=["gemma", "phi3"])
def test_families_without_a_name_here_capture_from_their_configuration(layout, config):
    ladder = build_ladder(config, layout, decode_batches=(8, 2), draft_tokens=4, context=256, layers=1).capture()
    assert sorted(ladder.graphs) == [("verify", 2), ("verify", 8)]
    vocab = config.vocab_size
    assert tuple(ladder.decode(2).shape) == (2, 4, vocab)
    # every graph's logits stay live in the pool: batch x draft tokens x vocab, bf16
    live = summarize(ladder.snapshot())["reserved_bytes"] - summarize(ladder.snapshot())["inactive_bytes"]
    assert live >= (8 + 2) * 4 * vocab * 2


def test_a_configuration_has_no_tiny_widths(backed):
    with pytest.raises(ParameterError, match="tiny widths exist for the named models only"):
        build_ladder(transformers.LlamaConfig(), backed, tiny=True)
    with pytest.raises(ParameterError, match="a transformers configuration"):
        ModelLadder(backed, model=42)
