"""Which allocations real CUDA code makes through the caching allocator (needs a GPU).

    python scripts/probe_allocations.py OUTDIR

The simulated device runs the same Python code as a GPU, but CUDA libraries allocate through
the caching allocator where the simulator may not (CUB temporaries of sort / cumsum /
searchsorted, cuBLAS and cuBLASLt workspaces, attention kernels' scratch). This probe records
the allocator trace, with Python stacks, of

- ``eagle_*``: one EAGLE verification step (``graphborrow.eagle.eagle_verify``) per mode and
  shape, each after a warm-up step, so only the step's own allocations are in the trace;
- ``model_*``: transformers causal-LM forwards (random weights from configs written here, a few
  layers, bf16, sdpa) of verify-shaped batches, eager and under CUDA graph capture into one pool.

Each probe is written as ``OUTDIR/<probe>.pickle.gz`` (the ``_snapshot()`` dict with the trace,
frames kept: they name the op that allocated) plus ``OUTDIR/index.json`` (torch, transformers,
device, command, and per probe the allocations as (action, size, stream) rows). A failing probe
is recorded with its error and the others run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EAGLE_POINTS = [  # (bs, draft tokens, vocab, mode, top_k, top_p)
    (4, 8, 128256, "standard", None, None),
    (4, 8, 128256, "lean", None, None),
    (4, 8, 128256, "standard", 50, 0.9),
    (32, 8, 128256, "standard", None, None),
    (1, 4, 32000, "standard", 20, 0.8),
]
TREES = {4: (1, 3), 8: (4, 3), 16: (4, 5)}


def start_history(max_entries: int = 500_000) -> None:
    torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=max_entries)


def stop_history() -> dict:
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def rows_of(snapshot: dict) -> list[list]:
    rows = []
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"):
                top = next((f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                            if "torch/" not in f["filename"] or "nn/functional" in f["filename"]), "")
                rows.append([e["action"], e.get("size", 0), e.get("stream", 0), top])
    return rows


def probe_eagle(bs, d, vocab, mode, top_k, top_p) -> dict:
    from graphborrow.eagle import eagle_verify
    from graphborrow.eagle.draft_tree import build_draft_tree

    topk, depth = TREES[d]
    g = torch.Generator().manual_seed(0)
    tree = build_draft_tree(topk, depth, d, bs, vocab, generator=g, device="cuda")
    logits = torch.randn(bs * d, vocab, device="cuda")
    coins = torch.rand(bs, d, device="cuda")
    coins_final = torch.rand(bs, device="cuda")

    def step():
        return eagle_verify(logits, None, tree, 1.0, top_ks=top_k, top_ps=top_p, coins=coins,
                            coins_final=coins_final, mode=mode)

    step()  # warm-up: library handles, workspaces, lazy init
    torch.cuda.synchronize()
    start_history()
    out = step()
    del out
    return stop_history()


def model_configs(layers: int) -> dict:
    import transformers as tf

    return {
        "llama3_8b": tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0),
        "qwen25_7b": tf.Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                                    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                    max_position_embeddings=32768),
        "mistral_7b": tf.MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                                       max_position_embeddings=32768),
        "mixtral_moe": tf.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=max(1, layers // 2),
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768),
    }


def probe_model(name, config, batches, draft_tokens, cache_len) -> dict:
    import transformers as tf

    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        try:
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers 4 spells it torch_dtype
            model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.eval()
    info = {"model": name, "cache": None}
    start_history()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    with torch.inference_mode():
        for bs in batches:  # largest first, as engines capture
            tokens = torch.randint(config.vocab_size, (bs, draft_tokens), device="cuda")
            position = torch.arange(cache_len - draft_tokens, cache_len, device="cuda").expand(bs, -1)
            kwargs = {"input_ids": tokens, "position_ids": position, "use_cache": False}
            try:
                try:  # transformers 5: layers are allocated lazily at the first update
                    cache = tf.StaticCache(config=config, max_cache_len=cache_len)
                except TypeError:
                    cache = tf.StaticCache(config=config, max_batch_size=bs, max_cache_len=cache_len,
                                           device="cuda", dtype=torch.bfloat16)
                kwargs.update(past_key_values=cache, use_cache=True,
                              cache_position=torch.arange(cache_len - draft_tokens, cache_len, device="cuda"))
                info["cache"] = "StaticCache"
            except Exception as exc:  # keep probing without a cache
                info["cache"] = f"none ({type(exc).__name__}: {exc})"[:300]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model(**kwargs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(**kwargs).logits
            graphs.append((graph, out, kwargs))
    snapshot = stop_history()
    snapshot["probe_info"] = info
    del graphs, model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return snapshot


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--skip-models", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_allocations.py needs a CUDA device")
    os.makedirs(args.outdir, exist_ok=True)
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    index = {"torch": torch.__version__, "transformers": tf_version, "device": torch.cuda.get_device_name(),
             "command": "python scripts/probe_allocations.py " + " ".join(sys.argv[1:]), "probes": {}}
    jobs = [(f"eagle_bs{bs}_d{d}_v{v}_{mode}" + ("_renorm" if k else ""), probe_eagle, (bs, d, v, mode, k, p))
            for bs, d, v, mode, k, p in EAGLE_POINTS]
    if not args.skip_models and tf_version:
        for name, config in model_configs(args.layers).items():
            jobs.append((f"model_{name}", probe_model, (name, config, (8, 4, 1), 8, 1024)))
    for name, fn, fargs in jobs:
        t0 = time.time()
        try:
            snapshot = fn(*fargs)
            with gzip.open(os.path.join(args.outdir, f"{name}.pickle.gz"), "wb") as f:
                pickle.dump(snapshot, f, protocol=4)
            rows = rows_of(snapshot)
            index["probes"][name] = {"seconds": round(time.time() - t0, 1), "info": snapshot.get("probe_info"),
                                     "rows": rows}
            print(f"{name}: {len(rows)} allocator events in {time.time() - t0:.1f} s", flush=True)
        except Exception as exc:
            torch.cuda.memory._record_memory_history(enabled=None)
            index["probes"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    with open(os.path.join(args.outdir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
