"""Model code written the ordinary way: transformers models as a user builds, converts and captures them.

:class:`graphborrow.workloads.models.ModelLadder` captures as SGLang does (static inputs,
a static KV cache, the model built in its serving dtype). Users write less careful code:
they build in float32 and convert with ``.to(torch.bfloat16)``, ``.half()`` or
``.bfloat16()``, call ``model(input_ids=ids)`` with no positions or masks, leave
``use_cache`` at its default, pick ``eager`` attention, capture smallest batch first, or
run under ``no_grad`` instead of ``inference_mode``. :func:`script` writes such a program
as plain Python source (``torch`` and ``transformers`` only, random weights from a
configuration, never a download), so the same text runs on a GPU and, unmodified, on the
simulated device; :data:`PLAIN_WORKLOADS` is the set recorded on the H200.
"""

from __future__ import annotations

import dataclasses

from graphborrow.core.errors import ParameterError

from .models import MODELS

__all__ = ["FAMILIES", "PLAIN_WORKLOADS", "PlainSpec", "script"]

# family -> (configuration class, model class, fields): published widths, random weights
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", MODELS["llama-3-8b"].fields),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", MODELS["qwen2.5-7b"].fields),
    "mistral": ("MistralConfig", "MistralForCausalLM", MODELS["mistral-7b"].fields),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32,
                  vocab_size=32064, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                  sliding_window=None, tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=3072, intermediate_size=24576, num_attention_heads=16, num_key_value_heads=16,
                   head_dim=256, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
                   rms_norm_eps=1e-6)),
}
_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512)
BUILDS = ("fp32_to", "fp32_half", "fp32_bfloat16", "direct", "cpu_to_cuda")
_DTYPE_OF_BUILD = {"fp32_to": "bfloat16", "fp32_half": "float16", "fp32_bfloat16": "bfloat16", "direct": "bfloat16",
                   "cpu_to_cuda": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class PlainSpec:
    """One ordinary script.

    ``build``: ``fp32_to`` (float32 on the device, then ``.to(torch.bfloat16)``), ``fp32_half``,
    ``fp32_bfloat16``, ``direct`` (``_from_config(config, dtype=torch.bfloat16)`` on the device)
    or ``cpu_to_cuda`` (float32 on the host, then ``.to("cuda", torch.bfloat16)``).
    ``mode``: ``graphs`` (per batch: warm up twice on a side stream, capture into one shared
    pool) or ``forwards`` (plain forwards, no graphs). ``inputs``: ``ids`` or ``ids_mask_positions``
    (a 2-D attention mask of ones and position ids as well).
    """

    family: str
    build: str = "fp32_to"
    attention: str = "sdpa"
    use_cache: bool = False
    order: str = "largest_first"
    grad: str = "inference_mode"
    mode: str = "graphs"
    layers: int = 2
    batches: tuple = (64, 32, 16, 8, 4, 2, 1)
    tokens: int = 8
    inputs: str = "ids"
    tiny: bool = False

    def __post_init__(self):
        choices = {"family": FAMILIES, "build": BUILDS, "attention": ("sdpa", "eager"),
                   "order": ("largest_first", "smallest_first"), "grad": ("inference_mode", "no_grad"),
                   "mode": ("graphs", "forwards"), "inputs": ("ids", "ids_mask_positions")}
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ParameterError(f"{field} must be one of {sorted(allowed)}, got {getattr(self, field)!r}")
        if self.layers < 1 or self.tokens < 1 or not self.batches or min(self.batches) < 1:
            raise ParameterError("layers, tokens and every batch size must be positive")


def _config_line(spec: PlainSpec) -> str:
    config_class, _, fields = FAMILIES[spec.family]
    fields = dict(fields, **(_TINY if spec.tiny else {}))
    if spec.tiny and spec.family == "qwen2":
        fields.pop("head_dim")
    fields.update(num_hidden_layers=spec.layers, attn_implementation=spec.attention)
    text = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"config = transformers.{config_class}({text})"


def _build_lines(spec: PlainSpec) -> list[str]:
    model_class = FAMILIES[spec.family][1]
    dtype = f"torch.{_DTYPE_OF_BUILD[spec.build]}"
    if spec.build == "direct":
        return ['with torch.device("cuda"):',
                f"    model = transformers.{model_class}._from_config(config, dtype={dtype})"]
    if spec.build == "cpu_to_cuda":
        return [f"model = transformers.{model_class}(config)", f'model = model.to("cuda", {dtype})']
    convert = {"fp32_to": f"model = model.to({dtype})", "fp32_half": "model.half()",
               "fp32_bfloat16": "model.bfloat16()"}[spec.build]
    return ['with torch.device("cuda"):', f"    model = transformers.{model_class}(config)", convert]


def _call(spec: PlainSpec) -> str:
    args = "input_ids=ids"
    if spec.inputs == "ids_mask_positions":
        args += ", attention_mask=mask, position_ids=positions"
    return f"model({args}, use_cache={spec.use_cache})"


def script(spec: PlainSpec) -> str:
    """The program ``spec`` describes, as Python source a user could have written.

    Args:
        spec: the script's choices.

    Returns:
        Source text that imports ``torch`` and ``transformers`` only and runs on ``cuda``.
    """
    batches = sorted(spec.batches, reverse=spec.order == "largest_first")
    lines = ["import torch", "import transformers", "", "torch.manual_seed(0)", _config_line(spec)]
    lines += _build_lines(spec)
    lines += ["model.eval()", "pool = torch.cuda.graph_pool_handle()", "graphs, outputs = {}, {}",
              f"with torch.{spec.grad}():", f"    for batch in {batches}:",
              f"        ids = torch.randint(0, config.vocab_size, (batch, {spec.tokens}), device='cuda')"]
    if spec.inputs == "ids_mask_positions":
        lines += ["        mask = torch.ones_like(ids)",
                  f"        positions = torch.arange({spec.tokens}, device='cuda')[None].expand(batch, -1)"]
    call = _call(spec)
    if spec.mode == "forwards":
        lines += [f"        out = {call}", "        outputs[batch] = out.logits", "        del out"]
    else:
        lines += ["        stream = torch.cuda.Stream()", "        stream.wait_stream(torch.cuda.current_stream())",
                  "        with torch.cuda.stream(stream):", "            for _ in range(2):",
                  f"                {call}", "        torch.cuda.current_stream().wait_stream(stream)",
                  "        graph = torch.cuda.CUDAGraph()", "        with torch.cuda.graph(graph, pool=pool):",
                  f"            logits = {call}.logits", "        graphs[batch] = graph",
                  "        outputs[batch] = (ids, logits)"]
    lines += ["torch.cuda.synchronize()"]
    return "\n".join(lines) + "\n"


def _workloads() -> dict[str, PlainSpec]:
    out: dict[str, PlainSpec] = {}
    for family in FAMILIES:
        layers = 4 if family == "llama" else 2
        out[f"{family}-fp32-to-bf16"] = PlainSpec(family, layers=layers)
        out[f"{family}-direct-bf16-smallest-nograd"] = PlainSpec(family, build="direct", order="smallest_first",
                                                                 grad="no_grad", layers=layers)
    llama = dict(family="llama", layers=4)
    out.update({
        "llama-fp32-half-nograd": PlainSpec(build="fp32_half", grad="no_grad", **llama),
        "llama-fp32-bfloat16-smallest": PlainSpec(build="fp32_bfloat16", order="smallest_first", **llama),
        "llama-direct-bf16": PlainSpec(build="direct", **llama),
        "llama-eager-graphs": PlainSpec(attention="eager", **llama),
        "llama-cache-graphs": PlainSpec(use_cache=True, **llama),
        "llama-eager-forwards": PlainSpec(attention="eager", mode="forwards", **llama),
        "llama-cache-forwards": PlainSpec(use_cache=True, mode="forwards", **llama),
        "llama-mask-positions-forwards": PlainSpec(inputs="ids_mask_positions", mode="forwards", **llama),
        "llama-mask-positions-graphs": PlainSpec(inputs="ids_mask_positions", build="direct", **llama),
        "llama-tiny-cpu-built": PlainSpec("llama", build="cpu_to_cuda", tiny=True),
        "qwen2-eager-cache-forwards": PlainSpec("qwen2", attention="eager", use_cache=True, mode="forwards",
                                                build="fp32_half", grad="no_grad"),
        "mistral-cache-forwards-smallest": PlainSpec("mistral", use_cache=True, mode="forwards",
                                                     order="smallest_first", build="direct"),
    })
    return out


PLAIN_WORKLOADS: dict[str, PlainSpec] = _workloads()
