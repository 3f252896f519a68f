"""Models whose output head shares the embedding's weight, built on the host and moved, as people do.

GPT-2, Gemma and the small Llama and Qwen models tie ``lm_head.weight`` to the input embedding:
one parameter in two modules. ``model.cuda()`` / ``model.to("cuda", dtype)`` must keep it one
tensor on the device (``Module._apply`` converts each parameter once and keeps it shared), so
the default pool holds the embedding once. Each script builds one of four families with its
published widths (two layers, random weights from the configuration, never a download) on the
host in float32 or on the device, converts and moves it one of the ways users do, checks the
tie, and captures a small decode ladder into one graph pool.
"""

from __future__ import annotations

from .generate import Program

__all__ = ["TIED_FAMILIES", "tied_programs"]

# family -> (configuration class, model class, fields): published widths of tied models, two layers
TIED_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=768, n_layer=2, n_head=12, vocab_size=50257,
                                                   n_positions=1024)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",  # Qwen2.5-0.5B
              dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                   vocab_size=151936, num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=4096)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",  # Llama-3.2-1B
              dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                   vocab_size=128256, num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=4096,
                   rope_theta=500000.0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",  # Gemma-2B
              dict(hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1,
                   head_dim=256, vocab_size=256000, num_hidden_layers=2, max_position_embeddings=4096)),
}

# build -> the lines that make ``model`` on the device
BUILDS: dict[str, list[str]] = {
    "cuda": ["model = transformers.{model}(config)", "model = model.cuda()"],
    "to_bf16": ["model = transformers.{model}(config)", "model = model.to('cuda', torch.bfloat16)"],
    "host_bf16_to": ["model = transformers.{model}(config).to(torch.bfloat16)", "model.to('cuda')"],
    "half_cuda": ["model = transformers.{model}(config)", "model = model.cuda().half()"],
    "device_tie": ["with torch.device('cuda'):", "    model = transformers.{model}(config)",
                   "model = model.bfloat16()", "model.tie_weights()"],
}


def tied_script(family: str, build: str, graphs: bool = True) -> str:
    """One script: ``family`` built by ``build``, the tie checked, a ladder captured (or forwards)."""
    config_class, model_class, fields = TIED_FAMILIES[family]
    text = ", ".join(f"{k}={v!r}" for k, v in dict(fields, attn_implementation="sdpa").items())
    lines = ["import torch", "import transformers", "", "torch.manual_seed(0)",
             f"config = transformers.{config_class}({text})"]
    lines += [ln.format(model=model_class) for ln in BUILDS[build]]
    lines += ["model.eval()",
              "assert model.get_output_embeddings().weight is model.get_input_embeddings().weight",
              "pool = torch.cuda.graph_pool_handle()", "graphs, outputs = {}, {}",
              "with torch.inference_mode():", "    for batch in (8, 4, 2, 1):",
              "        ids = torch.randint(0, config.vocab_size, (batch, 8), device='cuda')"]
    if graphs:
        lines += ["        stream = torch.cuda.Stream()", "        stream.wait_stream(torch.cuda.current_stream())",
                  "        with torch.cuda.stream(stream):", "            for _ in range(2):",
                  "                model(input_ids=ids, use_cache=False)",
                  "        torch.cuda.current_stream().wait_stream(stream)",
                  "        graph = torch.cuda.CUDAGraph()", "        with torch.cuda.graph(graph, pool=pool):",
                  "            logits = model(input_ids=ids, use_cache=False).logits",
                  "        graphs[batch] = graph", "        outputs[batch] = (ids, logits)"]
    else:
        lines += ["        outputs[batch] = model(input_ids=ids, use_cache=False).logits"]
    lines.append("torch.cuda.synchronize()")
    return "\n".join(lines) + "\n"


def tied_programs() -> list[Program]:
    """Every family in float32 (``.cuda()``) and bfloat16 (``.to('cuda', torch.bfloat16)``), and the
    other builds on two families (named ``tied_<family>-<build>``)."""
    specs = [(family, build) for family in TIED_FAMILIES for build in ("cuda", "to_bf16")]
    specs += [("gpt2", "host_bf16_to"), ("qwen2", "half_cuda"), ("llama", "device_tie"), ("gpt2", "device_tie")]
    programs = [Program(name=f"tied_{family}-{build}", kind="tied", source=tied_script(family, build))
                for family, build in specs]
    programs.append(Program(name="tied_qwen2-to_bf16-forwards", kind="tied",
                            source=tied_script("qwen2", "to_bf16", graphs=False)))
    return programs
