"""Random programs made of the operations model code uses, written out as Python source.

A program is a short script, one operation per line, that runs unmodified on a GPU and on
the simulated device (``torch.cuda`` mapped onto it, :mod:`graphborrow.sim.cuda_api`). Its
source is the record: the allocator trace each device writes names, for every event, the
line that made it, so a difference points at one operation.

The operations are those transformers models and serving code call: linear / matmul / bmm /
baddbmm, scaled-dot-product attention under each backend with each mask kind, softmax and
log-softmax, layer and RMS norms (fused and written out), embedding, gather / scatter /
index_select / index_put / index_copy, cat / stack / split / chunk, cumsum / sort / topk /
argsort / argmax and reductions, where / masked_fill, the factories, dtype conversions,
copies, views and rotary-style slicing, in-place arithmetic, and ``nn.Module`` conversions
(``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``, ``param.data = ...``). Around
them: side streams joined by ``wait_stream``, ``record_stream``, CUDA graph captures into
shared pools after a warm-up (bodies are functions, so their temporaries die inside the
capture as a model's do), replays, deletions in random order, ``empty_cache``, and a random
allocator setting (``PYTORCH_CUDA_ALLOC_CONF``) per program.

Values never decide an allocation: shapes are drawn here, index tensors are made in range
(``randint`` with the right bound), and data-dependent shapes come only from deterministic
data (``arange``-based masks).
"""

from __future__ import annotations

import dataclasses
import math
import random

__all__ = ["Program", "draw_settings", "generate"]

MiB = 2**20
FLOATS = ("float32", "float16", "bfloat16")
_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}
_TENSOR_LIMIT = 48 * MiB  # one tensor
_LIVE_LIMIT = 768 * MiB  # what the program keeps alive before it deletes half
_DIMS = (1, 1, 2, 3, 4, 5, 7, 8, 8, 12, 16, 16, 24, 32, 32, 48, 64, 64, 96, 100, 128, 128, 200, 256, 256,
         384, 512, 512, 768, 1000, 1024, 1024, 2048, 3000, 4096)
_HEAD_DIMS = (32, 64, 64, 80, 96, 128, 128, 128, 256)
_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


@dataclasses.dataclass(frozen=True)
class Program:
    """One program: its source, the allocator setting it runs under, and where it came from.

    ``kind`` is ``fuzz`` (drawn by :func:`generate`), ``rule`` (a capture rule), ``probe`` (one
    operation at many shapes) or ``model`` (ordinary transformers code).
    """

    name: str
    kind: str
    source: str
    settings: str = ""
    seed: int | None = None

    @property
    def filename(self) -> str:
        """The file name the program's frames carry (``<fuzz/name>``)."""
        return f"<fuzz/{self.name}>"


def draw_settings(rng: random.Random) -> str:
    """A ``PYTORCH_CUDA_ALLOC_CONF`` for one program: mostly the default, else one or two options."""
    kind = rng.random()
    if kind < 0.45:
        return ""
    options = []
    if kind < 0.65:
        options.append(f"max_split_size_mb:{rng.choice([20, 32, 64, 128])}")
    elif kind < 0.8:
        options.append(f"roundup_power2_divisions:{rng.choice([1, 2, 4, 8, 16])}")
    elif kind < 0.9:
        options.append("expandable_segments:True")
    else:
        options.append(f"max_split_size_mb:{rng.choice([32, 64])}")
        options.append(f"roundup_power2_divisions:{rng.choice([2, 4])}")
    return ",".join(options)


@dataclasses.dataclass
class _Var:
    shape: tuple
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _SIZE[self.dtype]

    @property
    def floating(self) -> bool:
        return self.dtype in FLOATS


def _torch_dtype(dtype: str) -> str:
    return f"torch.{dtype}"


class _Writer:
    """Draws operations and writes them as lines, keeping the shape and dtype of every live name."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lines: list[str] = []
        self.depth = 0
        self.vars: dict[str, _Var] = {}
        self.count = 0
        self.body: dict | None = None  # the capture body being written: {"locals": set}
        self.streams: list[str] = []
        self.pools: list[str] = []
        self.graphs: dict[str, str] = {}  # live graph -> its pool

    # ------------------------------------------------------------------ writing
    def emit(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def fresh(self, prefix: str = "t") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def define(self, name: str, shape, dtype: str) -> str:
        self.vars[name] = _Var(tuple(int(n) for n in shape), dtype)
        if self.body is not None:
            self.body["locals"].add(name)
        return name

    def live_bytes(self) -> int:
        return sum(v.nbytes for v in self.vars.values())

    # ------------------------------------------------------------------ drawing
    def dim(self, low: int = 1, high: int = 4096) -> int:
        choices = [d for d in _DIMS if low <= d <= high]
        return self.rng.choice(choices) if choices else low

    def shape(self, rank: int | None = None, dtype: str = "float32", limit: int = _TENSOR_LIMIT) -> tuple:
        rank = rank or self.rng.choice((1, 2, 2, 3, 3, 3, 4))
        for _ in range(20):
            shape = tuple(self.dim() for _ in range(rank))
            if math.prod(shape) * _SIZE[dtype] <= limit:
                return shape
        return tuple([1] * (rank - 1) + [self.dim(high=1024)])

    def float_dtype(self) -> str:
        return self.rng.choice(("float32", "float16", "bfloat16", "bfloat16"))

    def pick(self, test=lambda v: True, exclude=()) -> str | None:
        names = [n for n, v in self.vars.items() if test(v) and n not in exclude and self.visible(n)]
        return self.rng.choice(names) if names else None

    def visible(self, name: str) -> bool:
        return self.body is None or name in self.body["locals"] or name in self.body["inputs"]

    def mutable(self, name: str) -> bool:
        """In-place ops inside a capture body only on its own tensors (outer ones are its inputs)."""
        return self.body is None or name in self.body["locals"]

    def factory(self, shape, dtype: str, kind: str | None = None) -> str:
        """A new tensor from a device-side factory."""
        name = self.fresh()
        dims = ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "")
        dt = _torch_dtype(dtype)
        if dtype == "bool":
            self.emit(f"{name} = torch.rand(({dims}), device='cuda') > 0.5")
        elif dtype in ("int64", "int32"):
            self.emit(f"{name} = torch.randint(0, 1000, ({dims}), device='cuda', dtype={dt})")
        else:
            kind = kind or self.rng.choice(("randn", "randn", "rand", "zeros", "ones", "empty", "full"))
            if kind == "full":
                self.emit(f"{name} = torch.full(({dims}), {self.rng.choice([0.5, -1.0, 2.0])}, device='cuda', "
                          f"dtype={dt})")
            else:
                self.emit(f"{name} = torch.{kind}(({dims}), device='cuda', dtype={dt})")
        return self.define(name, shape, dtype)

    def floating(self, rank: int | None = None, last: int | None = None, dtype: str | None = None) -> str:
        """A live floating tensor (of ``rank`` / last dim / dtype when given), or a new one."""
        def ok(v):
            return (v.floating and v.shape and (rank is None or len(v.shape) == rank)
                    and (last is None or v.shape[-1] == last) and (dtype is None or v.dtype == dtype))
        found = self.pick(ok) if self.rng.random() < 0.6 else None
        if found:
            return found
        dtype = dtype or self.float_dtype()
        shape = list(self.shape(rank, dtype))
        if last is not None:
            shape[-1] = last
            while math.prod(shape) * _SIZE[dtype] > _TENSOR_LIMIT and max(shape[:-1], default=1) > 1:
                i = shape.index(max(shape[:-1]))
                shape[i] = max(1, shape[i] // 4)
        return self.factory(shape, dtype)

    def indices(self, shape, bound: int, dtype: str = "int64") -> str:
        name = self.fresh("i")
        dims = ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "")
        self.emit(f"{name} = torch.randint(0, {bound}, ({dims}), device='cuda', dtype={_torch_dtype(dtype)})")
        return self.define(name, shape, dtype)

    def result(self, expression: str, shape, dtype: str) -> str:
        name = self.fresh()
        self.emit(f"{name} = {expression}")
        return self.define(name, shape, dtype)

    # ------------------------------------------------------------------ operations
    def op_factory(self):
        dtype = self.rng.choice(FLOATS + ("int64", "bool", "float32", "bfloat16"))
        self.factory(self.shape(dtype=dtype), dtype)

    def op_arange(self):
        n = self.dim(2, 4096)
        dtype = self.rng.choice(("int64", "int64", "float32"))
        suffix = "" if dtype == "int64" else f", dtype={_torch_dtype(dtype)}"
        self.result(f"torch.arange({n}, device='cuda'{suffix})", (n,), dtype)

    def op_linear(self):
        x = self.floating()
        v = self.vars[x]
        k, n = v.shape[-1], self.dim(8, 4096)
        while math.prod(v.shape[:-1]) * n * _SIZE[v.dtype] > _TENSOR_LIMIT and n > 8:
            n //= 2
        w = self.factory((n, k), v.dtype, "randn") if n * k * _SIZE[v.dtype] <= _TENSOR_LIMIT else None
        if w is None:
            return
        bias = ""
        if self.rng.random() < 0.4:
            bias = ", " + self.factory((n,), v.dtype, "randn")
        form = self.rng.random()
        if form < 0.6 or bias:
            self.result(f"F.linear({x}, {w}{bias})", v.shape[:-1] + (n,), v.dtype)
        else:
            self.result(f"{x} @ {w}.t()", v.shape[:-1] + (n,), v.dtype)

    def op_bmm(self):
        dtype = self.float_dtype()
        b, m, k, n = self.dim(1, 64), self.dim(1, 1024), self.dim(8, 512), self.dim(1, 1024)
        if b * max(m * k, k * n, m * n) * _SIZE[dtype] > _TENSOR_LIMIT:
            b = 1
        a = self.factory((b, m, k), dtype, "randn")
        c = self.factory((b, k, n), dtype, "randn")
        form = self.rng.choice(("bmm", "matmul", "baddbmm", "einsum"))
        if form == "bmm":
            self.result(f"torch.bmm({a}, {c})", (b, m, n), dtype)
        elif form == "matmul":
            self.result(f"torch.matmul({a}, {c})", (b, m, n), dtype)
        elif form == "einsum":
            self.result(f"torch.einsum('bmk,bkn->bmn', {a}, {c})", (b, m, n), dtype)
        else:
            base = self.factory((b, m, n), dtype, "zeros")
            self.result(f"torch.baddbmm({base}, {a}, {c}, beta=0.5, alpha=2.0)", (b, m, n), dtype)

    def op_attention(self):
        rng = self.rng
        backend = rng.choice(_BACKENDS + (None, None))
        dtype = "float32" if backend in ("EFFICIENT_ATTENTION", "MATH") and rng.random() < 0.3 else rng.choice(
            ("float16", "bfloat16", "bfloat16"))
        b, h, d = self.dim(1, 16), rng.choice((1, 2, 4, 8, 16, 32)), rng.choice(_HEAD_DIMS)
        sq = rng.choice((1, 4, 8, 16, 64, 128, 333, 512, 1024))
        sk = rng.choice((sq, sq, sq + rng.choice((0, 8, 100, 1024))))
        while b * h * max(sq, sk) * max(d, sk) * 4 > _TENSOR_LIMIT and b > 1:
            b //= 2
        if b * h * max(sq, sk) * max(d, sk) * 4 > _TENSOR_LIMIT:
            h = 1
        hk = h if rng.random() < 0.6 else max(1, h // rng.choice((2, 4, 8)))
        strict = rng.random() < 0.9  # mostly inputs the forced backend takes (else: its refusal is the test)
        if strict and backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            dtype = rng.choice(("float16", "bfloat16"))
            d = min(d, 128) if backend == "CUDNN_ATTENTION" else d
        if strict and backend == "FLASH_ATTENTION":
            sk = sq
        gqa = hk != h
        q = self.factory((b, h, sq, d), dtype, "randn")
        if rng.random() < 0.3:  # projections laid out (b, s, h, d) and transposed, as model code does
            kv = self.factory((b, sk, hk, d), dtype, "randn")
            k = self.result(f"{kv}.transpose(1, 2)", (b, hk, sk, d), dtype)
            v = k
        else:
            k = self.factory((b, hk, sk, d), dtype, "randn")
            v = self.factory((b, hk, sk, d), dtype, "randn")
        mask_kind = rng.choice(("none", "none", "causal", "bool", "float", "bool_broadcast"))
        if strict and backend == "FLASH_ATTENTION":
            mask_kind = rng.choice(("none", "causal"))
        args = f"{q}, {k}, {v}"
        if mask_kind == "causal":
            args += ", is_causal=True"
        elif mask_kind in ("bool", "float", "bool_broadcast"):
            rows = 1 if mask_kind == "bool_broadcast" else b
            pos = self.result(f"torch.arange({sk}, device='cuda')", (sk,), "int64")
            base = sk - sq
            mask = self.result(f"({pos}[None, :] <= {pos}[{base}:, None])[None, None].expand({rows}, 1, {sq}, {sk})"
                               + (".contiguous()" if rng.random() < 0.7 else ""), (rows, 1, sq, sk), "bool")
            if mask_kind == "float":
                fmask = self.fresh()
                self.emit(f"{fmask} = torch.zeros({rows}, 1, {sq}, {sk}, device='cuda', dtype={_torch_dtype(dtype)})"
                          f".masked_fill(~{mask}, float('-inf'))")
                mask = self.define(fmask, (rows, 1, sq, sk), dtype)
            args += f", attn_mask={mask}"
        if gqa:
            args += ", enable_gqa=True"
        call = f"F.scaled_dot_product_attention({args})"
        if backend is None:
            self.result(call, (b, h, sq, d), dtype)
            return
        out = self.fresh()
        self.emit(f"with sdpa_kernel([SDPBackend.{backend}]):")
        self.emit(f"    {out} = {call}")
        self.define(out, (b, h, sq, d), dtype)
        if rng.random() < 0.5:  # the caller's (b, s, h*d) layout
            self.result(f"{out}.transpose(1, 2).reshape({b}, {sq}, {h * d})", (b, sq, h * d), dtype)

    def op_softmax(self):
        x = self.floating()
        v = self.vars[x]
        dim = self.rng.randrange(-len(v.shape), 0)
        form = self.rng.choice(("softmax", "log_softmax", "softmax_f32", "F.softmax"))
        if form == "softmax_f32":
            self.result(f"{x}.softmax({dim}, dtype=torch.float32)", v.shape, "float32")
        elif form == "F.softmax":
            self.result(f"F.softmax({x}.float(), dim={dim}).to({x}.dtype)", v.shape, v.dtype)
        else:
            self.result(f"{x}.{form}({dim})", v.shape, v.dtype)

    def op_norm(self):
        x = self.floating()
        v = self.vars[x]
        h = v.shape[-1]
        form = self.rng.choice(("layer_norm", "rms_norm", "manual_rms", "layer_norm_nobias"))
        if form == "manual_rms":
            var = self.result(f"{x}.float().pow(2).mean(-1, keepdim=True)", v.shape[:-1] + (1,), "float32")
            normed = self.result(f"{x}.float() * torch.rsqrt({var} + 1e-6)", v.shape, "float32")
            w = self.factory((h,), v.dtype, "ones")
            self.result(f"{w} * {normed}.to({x}.dtype)", v.shape, v.dtype)
            return
        w = self.factory((h,), v.dtype, "ones")
        if form == "rms_norm":
            self.result(f"F.rms_norm({x}, ({h},), {w}, eps=1e-6)", v.shape, v.dtype)
        elif form == "layer_norm":
            bias = self.factory((h,), v.dtype, "zeros")
            self.result(f"F.layer_norm({x}, ({h},), {w}, {bias})", v.shape, v.dtype)
        else:
            self.result(f"F.layer_norm({x}, ({h},), {w})", v.shape, v.dtype)

    def op_embedding(self):
        vocab, h = self.dim(8, 4096) * self.rng.choice((1, 8)), self.dim(8, 4096)
        dtype = self.float_dtype()
        while vocab * h * _SIZE[dtype] > _TENSOR_LIMIT:
            vocab //= 2
        table = self.factory((vocab, h), dtype, "randn")
        b, s = self.dim(1, 64), self.dim(1, 512)
        while b * s * h * _SIZE[dtype] > _TENSOR_LIMIT:
            b = max(1, b // 2)
            s = max(1, s // 2) if b == 1 else s
        ids = self.indices((b, s), vocab)
        self.result(f"F.embedding({ids}, {table})", (b, s, h), dtype)

    def op_gather_scatter(self):
        x = self.floating()
        v = self.vars[x]
        dim = self.rng.randrange(len(v.shape))
        form = self.rng.choice(("gather", "scatter", "scatter_add_", "index_select", "index_put", "index_copy_",
                                "index_add_", "setitem", "getitem"))
        n = v.shape[dim]
        if form == "gather":
            shape = tuple(max(1, s // self.rng.choice((1, 2))) for s in v.shape)
            idx = self.indices(shape, n)
            self.result(f"torch.gather({x}, {dim}, {idx})", shape, v.dtype)
        elif form in ("scatter", "scatter_add_"):
            if form == "scatter_add_" and not self.mutable(x):
                x = self.result(f"{x}.clone()", v.shape, v.dtype)
            shape = tuple(max(1, s // self.rng.choice((1, 2))) for s in v.shape)
            idx = self.indices(shape, n)
            src = self.factory(shape, v.dtype, "randn")
            if form == "scatter":
                self.result(f"{x}.scatter({dim}, {idx}, {src})", v.shape, v.dtype)
            else:
                self.emit(f"{x}.scatter_add_({dim}, {idx}, {src})")
        elif form == "index_select":
            k = self.dim(1, 512)
            idx = self.indices((k,), n)
            shape = v.shape[:dim] + (k,) + v.shape[dim + 1:]
            if math.prod(shape) * _SIZE[v.dtype] <= _TENSOR_LIMIT:
                self.result(f"torch.index_select({x}, {dim}, {idx})", shape, v.dtype)
        elif form in ("index_put", "index_copy_", "index_add_", "setitem"):
            if not self.mutable(x):
                x = self.result(f"{x}.clone()", v.shape, v.dtype)
            k = max(1, min(n, self.dim(1, 64)))
            if form == "index_put":
                idx = self.indices((k,), v.shape[0])
                accumulate = self.rng.choice(("True", "False"))
                vals = self.factory((k,) + v.shape[1:], v.dtype, "randn")
                self.emit(f"{x}.index_put_(({idx},), {vals}, accumulate={accumulate})")
            elif form == "setitem":
                idx = self.indices((k,), v.shape[0])
                self.emit(f"{x}[{idx}] = {self.rng.choice(['0.0', '1.5'])}")
            else:
                perm = self.result(f"torch.randperm({n}, device='cuda')[:{k}]", (k,), "int64")
                src = self.factory(v.shape[:dim] + (k,) + v.shape[dim + 1:], v.dtype, "randn")
                self.emit(f"{x}.{form}({dim}, {perm}, {src})")
        else:  # advanced indexing along the first dim
            k = self.dim(1, 256)
            idx = self.indices((k,), v.shape[0])
            shape = (k,) + v.shape[1:]
            if math.prod(shape) * _SIZE[v.dtype] <= _TENSOR_LIMIT:
                self.result(f"{x}[{idx}]", shape, v.dtype)

    def op_cat(self):
        x = self.floating()
        v = self.vars[x]
        dim = self.rng.randrange(len(v.shape))
        parts = [x]
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            shape = list(v.shape)
            shape[dim] = self.dim(1, 512)
            if math.prod(shape) * _SIZE[v.dtype] > _TENSOR_LIMIT:
                break
            parts.append(self.factory(shape, v.dtype, "randn"))
        total = list(v.shape)
        total[dim] = sum(self.vars[p].shape[dim] for p in parts)
        if math.prod(total) * _SIZE[v.dtype] > 2 * _TENSOR_LIMIT:
            return
        if self.rng.random() < 0.2 and all(self.vars[p].shape == v.shape for p in parts):
            self.result(f"torch.stack([{', '.join(parts)}], dim={dim})",
                        v.shape[:dim] + (len(parts),) + v.shape[dim:], v.dtype)
        else:
            self.result(f"torch.cat([{', '.join(parts)}], dim={dim})", total, v.dtype)

    def op_split(self):
        x = self.floating()
        v = self.vars[x]
        dim = self.rng.randrange(len(v.shape))
        n = v.shape[dim]
        pieces = self.rng.choice((2, 3, 4))
        if n < pieces:
            return
        size = -(-n // pieces)
        names = [self.fresh() for _ in range(-(-n // size))]
        form = self.rng.choice(("split", "chunk", "unbind"))
        if form == "unbind" and n <= 8:
            names = [self.fresh() for _ in range(n)]
            self.emit(f"{', '.join(names)}, = {x}.unbind({dim})")
            for name in names:
                self.define(name, v.shape[:dim] + v.shape[dim + 1:], v.dtype)
            return
        call = f"{x}.split({size}, dim={dim})" if form == "split" else f"{x}.chunk({pieces}, dim={dim})"
        if form == "chunk":
            names = [self.fresh() for _ in range(-(-n // size))]
        self.emit(f"{', '.join(names)}, = {call}")
        for i, name in enumerate(names):
            shape = list(v.shape)
            shape[dim] = min(size, n - i * size)
            self.define(name, shape, v.dtype)
        if self.rng.random() < 0.5:
            self.result(f"{names[0]}.contiguous()", self.vars[names[0]].shape, v.dtype)

    def op_scan_sort(self):
        rng = self.rng
        form = rng.choice(("cumsum", "cumsum_int", "sort", "topk", "argsort", "argmax", "max_dim", "sort_large"))
        if form == "cumsum_int":
            b, n = self.dim(1, 64), self.dim(1, 4096)
            mask = self.factory((b, n), rng.choice(("bool", "int64", "int32")))
            self.result(f"{mask}.cumsum(-1)", (b, n), "int64")
            return
        if form == "sort_large":
            n = rng.choice((4097, 8192, 32000, 128256))
            b = rng.choice((1, 2, 8, 32))
            x = self.factory((b, n), rng.choice(("float32", "bfloat16")), "randn")
        else:
            x = self.floating()
        v = self.vars[x]
        dim = rng.randrange(-len(v.shape), 0)
        if form == "cumsum":
            self.result(f"torch.cumsum({x}, dim={dim})", v.shape, v.dtype)
        elif form in ("sort", "sort_large"):
            values, order = self.fresh(), self.fresh("i")
            self.emit(f"{values}, {order} = torch.sort({x}, dim={dim}, descending={rng.choice(['True', 'False'])})")
            self.define(values, v.shape, v.dtype)
            self.define(order, v.shape, "int64")
        elif form == "topk":
            k = max(1, min(v.shape[dim], rng.choice((1, 2, 8, 20, 50, 100))))
            values, order = self.fresh(), self.fresh("i")
            self.emit(f"{values}, {order} = torch.topk({x}, {k}, dim={dim})")
            shape = list(v.shape)
            shape[dim] = k
            self.define(values, shape, v.dtype)
            self.define(order, shape, "int64")
        elif form == "argsort":
            self.result(f"torch.argsort({x}, dim={dim}, descending=True)", v.shape, "int64")
        elif form == "argmax":
            shape = v.shape[:len(v.shape) + dim] + v.shape[len(v.shape) + dim + 1:]
            self.result(f"{x}.argmax(dim={dim})", shape, "int64")
        else:
            values, order = self.fresh(), self.fresh("i")
            self.emit(f"{values}, {order} = {x}.max(dim={dim})")
            shape = v.shape[:len(v.shape) + dim] + v.shape[len(v.shape) + dim + 1:]
            self.define(values, shape, v.dtype)
            self.define(order, shape, "int64")

    def op_reduce(self):
        x = self.floating()
        v = self.vars[x]
        form = self.rng.choice(("sum", "mean", "amax", "sum_all", "mean_all", "norm", "any", "var"))
        dim = self.rng.randrange(-len(v.shape), 0)
        keep = self.rng.random() < 0.5
        shape = list(v.shape)
        if keep:
            shape[dim] = 1
        else:
            del shape[dim]
        if form in ("sum", "mean", "amax"):
            self.result(f"{x}.{form}(dim={dim}, keepdim={keep})", shape, v.dtype)
        elif form == "sum_all":
            self.result(f"{x}.sum()", (), v.dtype)
        elif form == "mean_all":
            self.result(f"{x}.float().mean()", (), "float32")
        elif form == "norm":
            self.result(f"torch.linalg.vector_norm({x}, dim={dim}, keepdim={keep})", shape, v.dtype)
        elif form == "var":
            self.result(f"{x}.float().var(dim={dim}, keepdim={keep})", shape, "float32")
        else:
            self.result(f"({x} > 0).any(dim={dim}, keepdim={keep})", shape, "bool")

    def op_where(self):
        x = self.floating()
        v = self.vars[x]
        form = self.rng.choice(("where_scalar", "where_tensor", "masked_fill", "masked_fill_", "where_min"))
        mask = self.result(f"{x} > 0", v.shape, "bool")
        if form == "where_scalar":
            self.result(f"torch.where({mask}, {x}, 0.0)", v.shape, v.dtype)
        elif form == "where_tensor":
            other = self.factory(v.shape, v.dtype, "randn")
            self.result(f"torch.where({mask}, {x}, {other})", v.shape, v.dtype)
        elif form == "where_min":
            self.result(f"torch.where({mask}, 0.0, torch.finfo({_torch_dtype(v.dtype)}).min)", v.shape, "float32")
        elif form == "masked_fill":
            self.result(f"{x}.masked_fill({mask}, float('-inf'))", v.shape, v.dtype)
        elif self.mutable(x):
            self.emit(f"{x}.masked_fill_({mask}, 0.0)")

    def op_convert(self):
        x = self.pick(lambda v: v.nbytes <= _TENSOR_LIMIT) or self.floating()
        v = self.vars[x]
        rng = self.rng
        target = rng.choice(FLOATS + ("float32",)) if v.floating else rng.choice(FLOATS + ("int64",))
        form = rng.choice(("to", "method", "copy_", "to_copy", "type", "contiguous_t", "view_dtype", "reshape_t"))
        if form == "to":
            self.result(f"{x}.to({_torch_dtype(target)})", v.shape, target)
        elif form == "method" and target in FLOATS:
            method = {"float32": "float", "float16": "half", "bfloat16": "bfloat16"}[target]
            self.result(f"{x}.{method}()", v.shape, target)
        elif form == "copy_":
            dst = self.factory(v.shape, target, "empty") if target in FLOATS else self.factory(v.shape, target)
            self.emit(f"{dst}.copy_({x})")
        elif form == "to_copy":
            self.result(f"{x}.to(dtype={_torch_dtype(target)}, copy=True)", v.shape, target)
        elif form == "type" and target in FLOATS:
            self.result(f"{x}.type({_torch_dtype(target)})", v.shape, target)
        elif form == "contiguous_t" and len(v.shape) >= 2:
            shape = v.shape[:-2] + (v.shape[-1], v.shape[-2])
            t = self.result(f"{x}.transpose(-1, -2)", shape, v.dtype)
            self.result(f"{t}.to({_torch_dtype(target)}).contiguous()", shape, target)
        elif form == "view_dtype" and v.dtype in ("float32", "float16", "bfloat16") and v.shape:
            other = {"float32": "int32", "float16": "bfloat16", "bfloat16": "float16"}[v.dtype]
            self.result(f"{x}.view({_torch_dtype(other)})", v.shape, other)
        elif form == "reshape_t" and len(v.shape) >= 2:
            shape = v.shape[:-2] + (v.shape[-1], v.shape[-2])
            t = self.result(f"{x}.transpose(-1, -2)", shape, v.dtype)
            self.result(f"{t}.reshape(-1)", (math.prod(shape),), v.dtype)

    def op_view(self):
        x = self.floating()
        v = self.vars[x]
        form = self.rng.choice(("view", "expand", "permute", "unsqueeze", "flatten", "narrow", "select", "t_contig"))
        if form == "view":
            if self.rng.random() < 0.5:
                self.result(f"{x}.reshape(-1)", (math.prod(v.shape),), v.dtype)
            else:
                self.result(f"{x}.reshape({v.shape[0]}, -1)", (v.shape[0], math.prod(v.shape[1:])), v.dtype)
        elif form == "expand":
            shape = (self.rng.choice((2, 4, 8)),) + v.shape
            if math.prod(shape) * _SIZE[v.dtype] <= _TENSOR_LIMIT:
                e = self.result(f"{x}.unsqueeze(0).expand({', '.join(str(n) for n in shape)})", shape, v.dtype)
                if self.rng.random() < 0.7:
                    self.result(f"{e}.contiguous()", shape, v.dtype)
        elif form == "permute" and len(v.shape) >= 2:
            order = list(range(len(v.shape)))
            self.rng.shuffle(order)
            p = self.result(f"{x}.permute({', '.join(map(str, order))})", tuple(v.shape[i] for i in order), v.dtype)
            self.result(f"{p}.contiguous()", tuple(v.shape[i] for i in order), v.dtype)
        elif form == "unsqueeze":
            self.result(f"{x}[:, None]" if len(v.shape) >= 1 else f"{x}[None]",
                        v.shape[:1] + (1,) + v.shape[1:], v.dtype)
        elif form == "flatten":
            self.result(f"{x}.flatten(0, -1).clone()", (math.prod(v.shape),), v.dtype)
        elif form == "narrow" and v.shape[-1] > 1:
            k = v.shape[-1] // 2
            n = self.result(f"{x}[..., :{k}]", v.shape[:-1] + (k,), v.dtype)
            self.result(f"{n}.contiguous()", v.shape[:-1] + (k,), v.dtype)
        elif form == "select" and len(v.shape) >= 2:
            self.result(f"{x}[-1]", v.shape[1:], v.dtype)
        elif form == "t_contig" and len(v.shape) == 2:
            self.result(f"{x}.t().contiguous()", v.shape[::-1], v.dtype)

    def op_rotary(self):
        dtype = self.float_dtype()
        b, h, s, d = self.dim(1, 32), self.rng.choice((1, 4, 8, 32)), self.dim(1, 512), self.rng.choice((64, 128))
        while b * h * s * d * 4 > _TENSOR_LIMIT and b > 1:
            b //= 2
        q = self.factory((b, h, s, d), dtype, "randn")
        pos = self.result(f"torch.arange({s}, device='cuda')[None].expand({b}, {s})", (b, s), "int64")
        inv = self.result(f"1.0 / (10000 ** (torch.arange(0, {d}, 2, device='cuda', dtype=torch.int64).float() / {d}))",
                          (d // 2,), "float32")
        freqs = self.result(f"({inv}[None, :, None].expand({b}, -1, 1) @ {pos}[:, None, :].float()).transpose(1, 2)",
                            (b, s, d // 2), "float32")
        emb = self.result(f"torch.cat(({freqs}, {freqs}), dim=-1)", (b, s, d), "float32")
        cos = self.result(f"{emb}.cos().to({_torch_dtype(dtype)})[:, None]", (b, 1, s, d), dtype)
        sin = self.result(f"{emb}.sin().to({_torch_dtype(dtype)})[:, None]", (b, 1, s, d), dtype)
        x1 = self.result(f"{q}[..., :{d // 2}]", (b, h, s, d // 2), dtype)
        x2 = self.result(f"{q}[..., {d // 2}:]", (b, h, s, d // 2), dtype)
        rot = self.result(f"torch.cat((-{x2}, {x1}), dim=-1)", (b, h, s, d), dtype)
        self.result(f"({q} * {cos}) + ({rot} * {sin})", (b, h, s, d), dtype)

    def op_elementwise(self):
        x = self.floating()
        v = self.vars[x]
        rng = self.rng
        form = rng.choice(("silu", "gelu", "mul", "add_mixed", "exp", "pow", "inplace", "iadd", "clamp_",
                           "div_", "tanh", "sigmoid", "neg", "scalar_pow"))
        if form in ("silu", "gelu", "exp", "tanh", "sigmoid", "neg"):
            call = {"silu": f"F.silu({x})", "gelu": f"F.gelu({x}, approximate='tanh')", "exp": f"{x}.exp()",
                    "tanh": f"torch.tanh({x})", "sigmoid": f"torch.sigmoid({x})", "neg": f"-{x}"}[form]
            self.result(call, v.shape, v.dtype)
        elif form == "mul":
            y = self.factory(v.shape, v.dtype, "randn")
            self.result(f"{x} * {y}", v.shape, v.dtype)
        elif form == "add_mixed":
            other = "float32" if v.dtype != "float32" else "bfloat16"
            y = self.factory(v.shape[-1:], other, "randn")
            self.result(f"{x} + {y}", v.shape, "float32")
        elif form == "pow":
            self.result(f"{x}.pow(2)", v.shape, v.dtype)
        elif form == "scalar_pow":
            self.result(f"2.0 ** {x}", v.shape, v.dtype)
        elif self.mutable(x):
            statement = {"inplace": f"{x}.mul_(0.5)", "iadd": f"{x} += 1.0", "clamp_": f"{x}.clamp_(-1.0, 1.0)",
                         "div_": f"{x}.div_(2.0)"}[form]
            self.emit(statement)

    def op_module(self):
        rng = self.rng
        name = self.fresh("m")
        n_in, n_out = self.dim(8, 4096), self.dim(8, 4096)
        while n_in * n_out * 4 > _TENSOR_LIMIT:
            n_out //= 2
        bias = rng.choice(("True", "False"))
        built = rng.choice(("float32", "float32", "bfloat16", "float16"))
        kind = rng.choice(("linear", "linear", "linear", "embedding", "layernorm", "mlp"))
        dt = "" if built == "float32" else f", dtype={_torch_dtype(built)}"
        built_as = {
            "linear": f"torch.nn.Linear({n_in}, {n_out}, bias={bias}, device='cuda'{dt})",
            "embedding": f"torch.nn.Embedding({n_out}, {n_in}, device='cuda'{dt})",
            "layernorm": f"torch.nn.LayerNorm({n_in}, device='cuda'{dt})",
            "mlp": (f"torch.nn.Sequential(torch.nn.Linear({n_in}, {n_out}, bias={bias}), torch.nn.SiLU(), "
                    f"torch.nn.Linear({n_out}, {n_in}, bias={bias})).to(device='cuda'{dt})"),
        }
        self.emit(f"{name} = {built_as[kind]}")
        dtype, uniform = built, True
        first = f"{name}[0]" if kind == "mlp" else name
        for _ in range(rng.choice((1, 1, 2))):
            target = rng.choice(FLOATS)
            t = _torch_dtype(target)
            form = rng.choice(("to", "method", "to_kw", "type", "apply_data", "param_data"))
            method = {"float32": "float", "float16": "half", "bfloat16": "bfloat16"}[target]
            self.emit({"to": f"{name}.to({t})", "to_kw": f"{name} = {name}.to(device='cuda', dtype={t})",
                       "method": f"{name}.{method}()", "type": f"{name}.type({t})",
                       "apply_data": f"for p in {name}.parameters(): p.data = p.data.to({t})",
                       "param_data": f"{first}.weight.data = {first}.weight.data.to({t})"}[form])
            if form == "param_data":  # only the weight converted: a module of mixed dtypes unless alone
                has_other = kind == "mlp" or (kind == "linear" and bias == "True") or kind == "layernorm"
                uniform = uniform and not (has_other and target != dtype)
            dtype = target
        if not uniform:  # a module of mixed dtypes: kept alive, not called
            return
        if kind == "embedding":
            ids = self.indices((self.dim(1, 64), self.dim(1, 256)), n_out)
            self.result(f"{name}({ids})", self.vars[ids].shape + (n_in,), dtype)
        else:
            x = self.floating(last=n_in, dtype=dtype)
            out = n_out if kind == "linear" else n_in
            self.result(f"{name}({x})", self.vars[x].shape[:-1] + (out,), dtype)

    def op_masked_select(self):
        """A data-dependent shape from deterministic data (outside captures only)."""
        n = self.dim(2, 4096)
        pos = self.result(f"torch.arange({n}, device='cuda')", (n,), "int64")
        k = self.rng.choice((2, 3, 7))
        form = self.rng.choice(("nonzero", "masked_select", "bool_index"))
        count = len(range(0, n, k))
        if form == "nonzero":
            self.result(f"({pos} % {k} == 0).nonzero()", (count, 1), "int64")
        elif form == "masked_select":
            self.result(f"{pos}.masked_select({pos} % {k} == 0)", (count,), "int64")
        else:
            x = self.factory((n, self.dim(1, 256)), self.float_dtype(), "randn")
            self.result(f"{x}[{pos} % {k} == 0]", (count, self.vars[x].shape[1]), self.vars[x].dtype)

    def op_host_tensor(self):
        """``torch.tensor`` / ``.to('cuda')`` from host data (outside captures only)."""
        form = self.rng.choice(("tensor", "to_cuda", "pinned"))
        n = self.dim(1, 256)
        if form == "tensor":
            self.result(f"torch.tensor({[round(self.rng.random(), 3) for _ in range(min(n, 8))]}, device='cuda')",
                        (min(n, 8),), "float32")
        elif form == "to_cuda":
            self.result(f"torch.arange({n}).to('cuda')", (n,), "int64")
        else:
            self.result(f"torch.arange({n}).pin_memory().to('cuda', non_blocking=True)", (n,), "int64")

    def op_delete(self):
        names = [n for n in self.vars if self.visible(n) and (self.body is None or n in self.body["locals"])]
        if names:
            victims = self.rng.sample(names, min(len(names), self.rng.choice((1, 1, 2, 3))))
            self.emit(f"del {', '.join(victims)}")
            for n in victims:
                del self.vars[n]
                if self.body is not None:
                    self.body["locals"].discard(n)

    # --------------------------------------------------------------- structure
    OPS = {  # operation -> weight
        "op_linear": 10, "op_bmm": 4, "op_attention": 8, "op_softmax": 5, "op_norm": 5, "op_embedding": 3,
        "op_gather_scatter": 6, "op_cat": 4, "op_split": 3, "op_scan_sort": 6, "op_reduce": 5, "op_where": 4,
        "op_convert": 6, "op_view": 5, "op_rotary": 2, "op_elementwise": 6, "op_factory": 3, "op_arange": 1,
        "op_module": 4, "op_delete": 10,
    }
    OUTSIDE_CAPTURE = {"op_masked_select": 1, "op_host_tensor": 2}

    def one_op(self, capture: bool) -> None:
        table = dict(self.OPS)
        if not capture:
            table.update(self.OUTSIDE_CAPTURE)
            table.pop("op_module", None) if self.rng.random() < 0.5 else None
        else:
            table.pop("op_module")
        names, weights = zip(*table.items())
        getattr(self, self.rng.choices(names, weights)[0])()
        if self.live_bytes() > _LIVE_LIMIT:
            names = [n for n in self.vars if self.visible(n) and (self.body is None or n in self.body["locals"])]
            victims = sorted(names, key=lambda n: -self.vars[n].nbytes)[: max(1, len(names) // 2)]
            if victims:
                self.emit(f"del {', '.join(victims)}")
                for n in victims:
                    del self.vars[n]
                    if self.body is not None:
                        self.body["locals"].discard(n)

    def reuse_or_new(self, names: list, prefix: str, make: str, chance: float) -> str:
        """One of ``names`` at random, after making a new one (``make``) when there is none, or by ``chance``."""
        if not names or self.rng.random() < chance:
            name = self.fresh(prefix)
            self.emit(f"{name} = {make}")
            names.append(name)
        return self.rng.choice(names)

    def side_stream(self) -> None:
        rng = self.rng
        s = self.reuse_or_new(self.streams, "s", "torch.cuda.Stream()", 0.3)
        self.emit(f"{s}.wait_stream(torch.cuda.current_stream())")
        self.emit(f"with torch.cuda.stream({s}):")
        self.depth += 1
        for _ in range(rng.randint(1, 5)):
            self.one_op(capture=False)
        self.emit("pass")
        self.depth -= 1
        self.emit(f"torch.cuda.current_stream().wait_stream({s})")
        if rng.random() < 0.3:  # a tensor of the default stream used there, freed later: a deferred free
            x = self.pick()
            if x is not None:
                if rng.random() < 0.5:
                    self.emit(f"with torch.cuda.stream({s}): torch.cuda._sleep(2_000_000_000)")
                self.emit(f"{x}.record_stream({s})")
                self.emit(f"del {x}")
                del self.vars[x]

    def capture(self) -> None:
        rng = self.rng
        pool = self.reuse_or_new(self.pools, "pool", "torch.cuda.graph_pool_handle()", 0.25)
        body = self.fresh("body")
        inputs = {n for n in self.vars}
        saved_vars = dict(self.vars)
        self.body = {"locals": set(), "inputs": inputs}
        self.emit(f"def {body}():")
        self.depth += 1
        marker = len(self.lines)
        for _ in range(rng.randint(2, 10)):
            self.one_op(capture=True)
        outputs = sorted(n for n in self.body["locals"] if n in self.vars)  # a set: sorted, so the draw repeats
        exported = rng.sample(outputs, min(len(outputs), rng.choice((1, 2, 3)))) if outputs else []
        if exported:
            self.lines.insert(marker, "    " * self.depth + f"global {', '.join(exported)}")
        self.emit("pass")
        self.depth -= 1
        self.vars = {n: v for n, v in self.vars.items() if n in saved_vars or n in exported}
        self.body = None
        if rng.random() < 0.85:  # warm up on a side stream first, as torch's documentation does
            s = self.fresh("s")
            self.emit(f"{s} = torch.cuda.Stream()")
            self.emit(f"{s}.wait_stream(torch.cuda.current_stream())")
            self.emit(f"with torch.cuda.stream({s}):")
            self.emit(f"    {body}()")
            self.emit(f"torch.cuda.current_stream().wait_stream({s})")
        g = self.fresh("g")
        self.emit(f"{g} = torch.cuda.CUDAGraph()")
        self.emit(f"with torch.cuda.graph({g}, pool={pool}):")
        self.emit(f"    {body}()")
        self.graphs[g] = pool
        if rng.random() < 0.7:
            self.emit(f"{g}.replay()")

    def program(self, steps: int) -> None:
        rng = self.rng
        for _ in range(steps):
            r = rng.random()
            if r < 0.06:
                self.side_stream()
            elif r < 0.13:
                self.capture()
            elif r < 0.15 and self.graphs:
                g = rng.choice(sorted(self.graphs))
                if rng.random() < 0.7:
                    self.emit(f"{g}.replay()")
                else:  # a pool whose last graph is gone is released: later captures take a new handle
                    self.emit(f"del {g}")
                    pool = self.graphs.pop(g)
                    if pool not in self.graphs.values():
                        self.pools.remove(pool)
            elif r < 0.16:
                self.emit("torch.cuda.empty_cache()")
            elif r < 0.17:
                self.emit("torch.cuda.synchronize()")
            else:
                self.one_op(capture=False)


_PREAMBLE = """import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.manual_seed({seed})
"""


def generate(seed: int, steps: int | None = None) -> Program:
    """The random program of ``seed`` (the same source on every machine and Python version).

    Args:
        seed: any integer.
        steps: operations to draw (default: 30 to 70, drawn from the seed).

    Returns:
        A :class:`Program` of kind ``fuzz`` with its allocator setting.
    """
    rng = random.Random(f"graphborrow-fuzz-{seed}")
    settings = draw_settings(rng)
    writer = _Writer(rng)
    mode = rng.choice(("inference_mode", "inference_mode", "no_grad", "plain"))
    if mode != "plain":
        writer.emit(f"with torch.{mode}():")
        writer.depth = 1
    writer.program(steps if steps is not None else rng.randint(30, 70))
    writer.emit("torch.cuda.synchronize()")
    source = _PREAMBLE.format(seed=seed) + "\n".join(writer.lines) + "\n"
    return Program(name=f"fuzz{seed:04d}", kind="fuzz", source=source, settings=settings, seed=seed)
