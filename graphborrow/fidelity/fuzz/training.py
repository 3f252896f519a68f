"""Random training programs: a small model, a loss, ``backward()``, an optimizer step, written as source.

Training is where autograd's memory lives: activations saved by the forward and freed as the
backward consumes them, gradients made by AccumulateGrad (or added into), optimizer state made
at the first step (AdamW's two moments, fused or foreach, SGD's momentum buffers) and
``zero_grad``. Each program builds a model the way people write one (a ``torch.nn.Module``
with embeddings, attention through ``scaled_dot_product_attention``, MLPs, layer and RMS
norms, dropout, sometimes the output head tied to the embedding), moves or converts it, and
trains it for a few steps: micro-batches accumulated, gradients clipped, ``zero_grad`` with
and without ``set_to_none``, ``torch.cuda.make_graphed_callables`` around a block or the whole
model, or the whole step captured into a CUDA graph with a capturable optimizer, as torch's
documentation shows. :func:`training_probes` are hand-written: one backward operation at a
few shapes, each step on its own lines, so the trace says what the CUDA kernel allocated.
"""

from __future__ import annotations

import random

from .generate import Program

__all__ = ["generate_training", "training_probes"]

_PREAMBLE = """import torch
import torch.nn.functional as F

torch.manual_seed({seed})
"""


class _Model:
    """The model's layers (``__init__`` lines) and its forward (lines), drawn together."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.init: list[str] = []
        self.forward: list[str] = []
        self.count = 0
        self.hidden = rng.choice((64, 128, 256, 256, 512, 768, 1024))
        self.tokens = rng.random() < 0.6  # token ids in, logits out; else features in, regression
        self.vocab = rng.choice((1000, 4096, 8192, 32000, 50257)) if self.tokens else 0
        self.features = rng.choice((16, 64, 256, 1024)) if not self.tokens else 0
        self.tied = self.tokens and rng.random() < 0.5
        self.attention = rng.random() < 0.6
        self.dropout = rng.random() < 0.25

    def layer(self, prefix: str, text: str) -> str:
        self.count += 1
        name = f"{prefix}{self.count}"
        self.init.append(f"self.{name} = {text}")
        return f"self.{name}"

    def norm(self) -> str:
        h = self.hidden
        kind = self.rng.choice(("layer", "layer", "rms", "layer_nobias"))
        text = {"layer": f"torch.nn.LayerNorm({h})", "rms": f"torch.nn.RMSNorm({h})",
                "layer_nobias": f"torch.nn.LayerNorm({h}, bias=False)"}[kind]
        return self.layer("ln", text)

    def attention_block(self) -> None:
        rng, h = self.rng, self.hidden
        head = rng.choice([d for d in (32, 64, 128) if d <= h])
        heads = h // head
        norm = self.norm()
        qkv = self.layer("qkv", f"torch.nn.Linear({h}, {3 * h}, bias={rng.choice(('True', 'False'))})")
        out = self.layer("o", f"torch.nn.Linear({h}, {h}, bias=False)")
        mask = rng.choice(("is_causal=True", "is_causal=True", ""))
        f = self.forward
        f.append(f"q, k, v = {qkv}({norm}(h)).view(b, s, 3, {heads}, {head}).permute(2, 0, 3, 1, 4)")
        dropout = ", dropout_p=0.1 if self.training else 0.0" if self.dropout and rng.random() < 0.3 else ""
        f.append(f"a = F.scaled_dot_product_attention(q, k, v{', ' + mask if mask else ''}{dropout})")
        f.append(f"h = h + {out}(a.transpose(1, 2).reshape(b, s, {h}))")

    def mlp_block(self) -> None:
        rng, h = self.rng, self.hidden
        inner = h * rng.choice((2, 4))
        norm = self.norm()
        gated = rng.random() < 0.4
        bias = rng.choice(("True", "False"))
        up = self.layer("up", f"torch.nn.Linear({h}, {inner}, bias={bias})")
        down = self.layer("down", f"torch.nn.Linear({inner}, {h}, bias={bias})")
        if gated:
            gate = self.layer("gate", f"torch.nn.Linear({h}, {inner}, bias=False)")
            self.forward.append(f"u = {norm}(h)")
            self.forward.append(f"m = F.silu({gate}(u)) * {up}(u)")
        else:
            act = rng.choice(("F.gelu", "F.relu", "F.silu", "torch.tanh"))
            self.forward.append(f"m = {act}({up}({norm}(h)))")
        if self.dropout:
            self.forward.append("m = F.dropout(m, 0.1, self.training)")
        self.forward.append(f"h = h + {down}(m)")

    def build(self) -> list[str]:
        """The class ``Net`` as source lines."""
        rng, h = self.rng, self.hidden
        if self.tokens:
            self.init.append(f"self.emb = torch.nn.Embedding({self.vocab}, {h})")
            self.forward.append("h = self.emb(x)")
        else:
            self.init.append(f"self.inp = torch.nn.Linear({self.features}, {h})")
            self.forward.append("h = self.inp(x)")
        self.forward.append("b, s, _ = h.shape")
        for _ in range(rng.choice((1, 1, 2, 3))):
            if self.attention and rng.random() < 0.7:
                self.attention_block()
            self.mlp_block()
        final = self.norm()
        if self.tokens:
            self.init.append(f"self.head = torch.nn.Linear({h}, {self.vocab}, bias=False)")
            if self.tied:
                self.init.append("self.head.weight = self.emb.weight")
        else:
            self.init.append(f"self.head = torch.nn.Linear({h}, {self.features})")
        self.forward.append(f"return self.head({final}(h))")
        lines = ["class Net(torch.nn.Module):", "    def __init__(self):", "        super().__init__()"]
        lines += ["        " + ln for ln in self.init]
        lines += ["", "    def forward(self, x):"] + ["        " + ln for ln in self.forward]
        return lines + ["", ""]


def _batch(model: _Model, rng: random.Random) -> tuple[int, int]:
    b = rng.choice((1, 2, 4, 8, 16))
    s = rng.choice((16, 32, 64, 128, 256, 512))
    width = max(model.vocab, model.hidden * 4, model.features)
    while b * s * width * 4 > 192 * 2**20 and b > 1:
        b //= 2
    while b * s * width * 4 > 192 * 2**20 and s > 16:
        s //= 2
    return b, s


def _optimizer(rng: random.Random, capturable: bool = False) -> str:
    if capturable:
        return rng.choice(("torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)",
                           "torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)",
                           "torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True, fused=True)",
                           "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)"))
    return rng.choice(("torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)",
                       "torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)",
                       "torch.optim.AdamW(model.parameters(), lr=1e-3)",
                       "torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)",
                       "torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)",
                       "torch.optim.SGD(model.parameters(), lr=0.1)",
                       "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)",
                       "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)"))


def _build(rng: random.Random) -> list[str]:
    form = rng.choice(("cuda", "cuda", "to", "device", "to_bf16", "device_bf16", "cuda_bf16"))
    return {
        "cuda": ["model = Net().cuda()"],
        "to": ["model = Net().to('cuda')"],
        "device": ["with torch.device('cuda'):", "    model = Net()"],
        "to_bf16": ["model = Net().to('cuda', torch.bfloat16)"],
        "device_bf16": ["with torch.device('cuda'):", "    model = Net()", "model = model.to(torch.bfloat16)"],
        "cuda_bf16": ["model = Net().cuda().bfloat16()"],
    }[form]


def _inputs(model: _Model, b: int, s: int, dtype: str, prefix: str = "", copy: bool = False) -> list[str]:
    """Lines making the batch ``x`` and target ``y`` (named with ``prefix``; written into them with
    ``copy``)."""
    if model.tokens:
        made = (f"torch.randint(0, {model.vocab}, ({b}, {s}), device='cuda')",) * 2
    else:
        made = (f"torch.randn({b}, {s}, {model.features}, device='cuda', dtype={dtype})",) * 2
    x, y = prefix + "x", prefix + "y"
    if copy:
        return [f"{x}.copy_({made[0]})", f"{y}.copy_({made[1]})"]
    return [f"{x} = {made[0]}", f"{y} = {made[1]}"]


def _loss(model: _Model, rng: random.Random, prefix: str = "") -> str:
    y = prefix + "y"
    if model.tokens:
        return rng.choice((f"loss = F.cross_entropy(out.float().view(-1, {model.vocab}), {y}.view(-1))",
                           f"loss = F.cross_entropy(out.view(-1, {model.vocab}), {y}.view(-1))"))
    return rng.choice((f"loss = F.mse_loss(out, {y})", f"loss = (out.float() - {y}.float()).pow(2).mean()",
                       f"loss = F.smooth_l1_loss(out, {y})"))


def _plain_loop(model: _Model, rng: random.Random, dtype: str) -> list[str]:
    lines = [f"opt = {_optimizer(rng)}"]
    steps, micro = rng.choice((1, 2, 2, 3)), rng.choice((1, 1, 2))
    none = rng.choice(("True", "True", "False"))
    clip = rng.random() < 0.3
    autocast = dtype == "torch.float32" and rng.random() < 0.15
    b, s = _batch(model, rng)
    lines.append(f"for step in range({steps}):")
    body = []
    zero_first = rng.random() < 0.5
    if zero_first:
        body.append(f"opt.zero_grad(set_to_none={none})")
    inner = _inputs(model, b, s, dtype)
    if autocast:
        inner += ["with torch.autocast('cuda', dtype=torch.bfloat16):", "    out = model(x)"]
    else:
        inner.append("out = model(x)")
    inner.append(_loss(model, rng))
    inner.append(f"(loss / {micro}).backward()" if micro > 1 else "loss.backward()")
    if rng.random() < 0.5:
        inner.append("del out, loss")
    if micro > 1:
        body.append(f"for micro in range({micro}):")
        body += ["    " + ln for ln in inner]
    else:
        body += inner
    if clip:
        body.append(f"torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0{rng.choice(('', ', foreach=True'))})")
    body.append("opt.step()")
    if not zero_first:
        body.append(f"opt.zero_grad(set_to_none={none})")
    return lines + ["    " + ln for ln in body]


def _graphed_loop(model: _Model, rng: random.Random, dtype: str) -> list[str]:
    """``make_graphed_callables`` around the whole model, then the loop calls the graphed model."""
    b, s = _batch(model, rng)
    lines = _inputs(model, b, s, dtype)
    lines.append(f"model = torch.cuda.make_graphed_callables(model, (x,){rng.choice(('', ', num_warmup_iters=2'))})")
    lines.append(f"opt = {_optimizer(rng)}")
    lines.append(f"for step in range({rng.choice((2, 3))}):")
    body = _inputs(model, b, s, dtype)
    body += ["out = model(x)", _loss(model, rng), "loss.backward()", "opt.step()",
             f"opt.zero_grad(set_to_none={rng.choice(('True', 'False'))})"]
    return lines + ["    " + ln for ln in body]


def _whole_step_capture(model: _Model, rng: random.Random, dtype: str) -> list[str]:
    """The whole step in one graph (torch's "whole-network capture"): static inputs, warm-up on a
    side stream, a capturable optimizer, ``zero_grad(set_to_none=True)`` before capture."""
    b, s = _batch(model, rng)
    lines = [f"opt = {_optimizer(rng, capturable=True)}"] + _inputs(model, b, s, dtype, prefix="static_")
    step = ["out = model(static_x)", _loss(model, rng, prefix="static_"), "loss.backward()", "opt.step()"]
    lines += ["side = torch.cuda.Stream()", "side.wait_stream(torch.cuda.current_stream())",
              "with torch.cuda.stream(side):", f"    for i in range({rng.choice((3, 3, 11))}):",
              "        opt.zero_grad(set_to_none=True)"]
    lines += ["        " + ln for ln in step]
    lines += ["torch.cuda.current_stream().wait_stream(side)", "g = torch.cuda.CUDAGraph()",
              "opt.zero_grad(set_to_none=True)", "with torch.cuda.graph(g):"]
    lines += ["    " + ln for ln in step]
    lines.append(f"for i in range({rng.choice((1, 2))}):")
    lines += ["    " + ln for ln in _inputs(model, b, s, dtype, prefix="static_", copy=True)]
    return lines + ["    g.replay()"]


def generate_training(seed: int) -> Program:
    """The random training program of ``seed`` (the same source on every machine).

    Returns:
        A :class:`Program` of kind ``train`` named ``train<seed>``, under the default allocator
        setting or, now and then, expandable segments.
    """
    rng = random.Random(f"graphborrow-train-{seed}")
    settings = rng.choice(("", "", "", "", "expandable_segments:True", "max_split_size_mb:64"))
    model = _Model(rng)
    lines = model.build()
    build = _build(rng)
    dtype = "torch.bfloat16" if "bf16" in "".join(build) or "bfloat16" in "".join(build) else "torch.float32"
    lines += build
    form = rng.random()
    if form < 0.65:
        lines += _plain_loop(model, rng, dtype)
    elif form < 0.85:
        lines += _graphed_loop(model, rng, dtype)
    else:
        lines += _whole_step_capture(model, rng, dtype)
    lines.append("torch.cuda.synchronize()")
    source = _PREAMBLE.format(seed=seed) + "\n\n" + "\n".join(lines) + "\n"
    return Program(name=f"train{seed:04d}", kind="train", source=source, settings=settings, seed=seed)


# ------------------------------------------------------------------------------ probes

_PROBE_HEADER = "import torch\nimport torch.nn.functional as F\n\ntorch.manual_seed(0)\n"


def _probe(name: str, cases: list[tuple[list[str], str]]) -> Program:
    """One program: per case, its inputs (one line each), the forward (``out = ...``), the backward,
    then everything deleted and a synchronize, so each line's events are one step's."""
    lines = []
    for setup, forward in cases:
        names = [ln.split(" = ")[0] for ln in setup]
        lines += setup + forward.splitlines() + ["out.float().sum().backward()", f"del out, {', '.join(names)}",
                                                 "torch.cuda.synchronize()"]
    return Program(name=f"train_probe_{name}", kind="train", source=_PROBE_HEADER + "\n".join(lines) + "\n")


def _leaf(name: str, shape, dtype: str, make: str = "randn") -> str:
    return f"{name} = torch.{make}({shape}, device='cuda', dtype=torch.{dtype}, requires_grad=True)"


def training_probes() -> list[Program]:
    """Backward operations one at a time over a few shapes and dtypes (named ``train_probe_<op>``)."""
    programs = []
    cases = []
    for dtype in ("float32", "bfloat16"):
        for rows, h in ((8, 64), (512, 1024), (4096, 4096)):
            x = _leaf("x", (rows, h), dtype)
            w, bias = _leaf("w", (h,), dtype, "ones"), _leaf("bias", (h,), dtype, "zeros")
            cases += [([x, w, bias], f"out = F.layer_norm(x, ({h},), w, bias)"),
                      ([x, w], f"out = F.rms_norm(x, ({h},), w)"), ([x], "out = F.softmax(x, -1)"),
                      ([x], "out = F.log_softmax(x.float(), -1)"), ([x], "out = F.gelu(x) * F.silu(x)"),
                      ([x], "out = F.dropout(x, 0.1)")]
    programs.append(_probe("norms_softmax", cases))
    cases = []
    for dtype in ("float32", "bfloat16"):
        for rows, k, n, bias in ((8, 64, 64, True), (512, 1024, 4096, True), (2048, 4096, 1024, False),
                                 (4096, 1024, 32000, False)):
            w, b = _leaf("w", (n, k), dtype), _leaf("bias", (n,), dtype, "zeros")
            call = f"F.linear(x, w{', bias' if bias else ''})"
            setup = [w, b] if bias else [w]
            cases += [([_leaf("x", (rows, k), dtype)] + setup, f"out = {call}"),
                      ([_leaf("x", (4, max(1, rows // 4), k), dtype)] + setup, f"out = {call}")]
    programs.append(_probe("linear", cases))
    cases = []
    for vocab, h, b, s in ((1000, 64, 2, 16), (32000, 1024, 4, 256), (50257, 768, 8, 512), (128256, 2048, 1, 1024)):
        for dtype in ("float32", "bfloat16"):
            ids = f"x = torch.randint(0, {vocab}, ({b}, {s}), device='cuda')"
            cases.append(([_leaf("w", (vocab, h), dtype), ids], "out = F.embedding(x, w)"))
            z, t = _leaf("z", (b * s, vocab), dtype), f"t = torch.randint(0, {vocab}, ({b * s},), device='cuda')"
            cases += [([z, t], "out = F.cross_entropy(z, t)"), ([z, t], "out = F.cross_entropy(z.float(), t)")]
    programs.append(_probe("embedding_cross_entropy", cases))
    cases = []
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH", None):
        for b, heads, s, d, dtype in ((1, 4, 64, 64, "bfloat16"), (4, 16, 512, 128, "bfloat16"),
                                      (2, 8, 1024, 64, "float16"), (2, 8, 256, 64, "float32")):
            if dtype == "float32" and backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                continue
            setup = [_leaf(n, (b, heads, s, d), dtype) for n in "qkv"]
            call = "out = F.scaled_dot_product_attention(q, k, v, is_causal=True)"
            if backend is not None:
                call = f"with sdpa_kernel([SDPBackend.{backend}]):\n    {call}"
            cases.append((setup, call))
    programs.append(_probe("attention", cases))
    for program in programs[-1:]:
        programs[-1] = Program(program.name, program.kind, program.source.replace(
            "import torch.nn.functional as F\n",
            "import torch.nn.functional as F\nfrom torch.nn.attention import SDPBackend, sdpa_kernel\n"))
    lines = []
    for n_params, size in ((4, 1024), (16, 65536), (8, 4 * 2**20)):
        for opt in ("torch.optim.AdamW(ps, lr=1e-3, fused=True)", "torch.optim.AdamW(ps, lr=1e-3, foreach=True)",
                    "torch.optim.AdamW(ps, lr=1e-3, foreach=False)", "torch.optim.SGD(ps, lr=0.1, momentum=0.9)",
                    "torch.optim.AdamW(ps, lr=1e-3, capturable=True)"):
            lines += [f"ps = [torch.randn({size}, device='cuda', requires_grad=True) for _ in range({n_params})]",
                      "for p in ps:", "    p.grad = torch.randn_like(p)", f"opt = {opt}", "opt.step()", "opt.step()",
                      "torch.nn.utils.clip_grad_norm_(ps, 1.0)", "opt.zero_grad(set_to_none=False)",
                      "opt.zero_grad(set_to_none=True)", "del opt, ps, p", "torch.cuda.synchronize()"]
    programs.append(Program(name="train_probe_optimizers", kind="train",
                            source=_PROBE_HEADER + "\n".join(lines) + "\n"))
    return programs
