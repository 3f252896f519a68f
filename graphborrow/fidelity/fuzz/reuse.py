"""Random captures with cross-stream frees: what ``graph_capture_record_stream_reuse`` changes.

Inside a CUDA graph capture, a block freed after ``record_stream`` cannot wait for an event
(event queries are illegal while capturing), so by default its free is deferred until the
capture ends. With ``PYTORCH_CUDA_ALLOC_CONF=graph_capture_record_stream_reuse:True`` the
allocator records the capture graph's current terminal nodes of every stream that used the
block ("free markers"), and at a later allocation on the block's stream frees it as soon as
every marker precedes that stream's terminals: the graph's own dependencies prove that
nothing can still use it. Each program captures one body of elementwise work, factories and
a few matmuls on the capture stream and forked side streams (joined back with
``wait_stream`` or an event), with tensors used on another stream, recorded there and
deleted, and allocations after joins and before them; every program is recorded twice, with
the option (``reuse<seed>``) and without it (``reuse<seed>_default``), so the corpus shows the
option's effect next to the default on the same program.
"""

from __future__ import annotations

import random

from .generate import Program

__all__ = ["REUSE", "generate_reuse"]

REUSE = "graph_capture_record_stream_reuse:True"
_SIZES = (256, 4096, 65536, 262144, 1_000_000, 1_048_576, 2_500_000, 5_000_000, 12_000_000)  # float32 elements


class _Body:
    """Draws the capture body: which tensors live on which stream, which streams are forked."""

    def __init__(self, rng: random.Random, streams: int) -> None:
        self.rng = rng
        self.lines: list[str] = []
        self.count = 0
        self.main: dict[str, int] = {}  # capture-stream tensors -> elements
        self.used_on: dict[str, set] = {}  # tensor -> side streams that used it
        self.side: dict[str, tuple[str, int]] = {}  # side-stream tensors -> (stream, elements)
        self.streams = [f"s{i}" for i in range(streams)]
        self.forked: set[str] = set()
        self.sizes = rng.sample(_SIZES, rng.choice((2, 3, 4)))

    def fresh(self) -> str:
        self.count += 1
        return f"t{self.count}"

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def make(self, where: str | None = None) -> str:
        """A new tensor on the capture stream (``where`` None) or on a forked side stream."""
        rng = self.rng
        n = rng.choice(self.sizes)
        name = self.fresh()
        same = [t for t, m in (self.main.items() if where is None else ()) if m == n]
        if same and rng.random() < 0.4:
            expr = rng.choice((f"{rng.choice(same)} * 2.0", f"{rng.choice(same)} + 1.0", f"torch.sigmoid({same[0]})"))
        else:
            expr = rng.choice((f"torch.randn({n}, device='cuda')", f"torch.zeros({n}, device='cuda')",
                               f"torch.empty({n}, device='cuda')", f"torch.rand({n}, device='cuda')"))
        if where is None:
            self.emit(f"{name} = {expr}")
            self.main[name] = n
        else:
            self.emit(f"with torch.cuda.stream({where}):")
            self.emit(f"    {name} = {expr}")
            self.side[name] = (where, n)
        return name

    def op_alloc(self) -> None:
        if self.rng.random() < 0.12:
            k = self.rng.choice((256, 1024, 2048))
            name = self.fresh()
            self.emit(f"{name} = (w{k} @ w{k}).flatten()")
            self.main[name] = k * k
        else:
            self.make()

    def op_fork(self) -> None:
        s = self.rng.choice(self.streams)
        self.emit(f"{s}.wait_stream(torch.cuda.current_stream())")
        self.forked.add(s)

    def op_side_use(self) -> None:
        if not self.forked or not self.main:
            return self.op_fork()
        s = self.rng.choice(sorted(self.forked))
        t = self.rng.choice(sorted(self.main))
        name = self.fresh()
        self.emit(f"with torch.cuda.stream({s}):")
        self.emit(f"    {name} = {t} * 3.0" if self.rng.random() < 0.7 else f"    {t}.mul_(0.5)")
        if self.lines[-1].startswith(f"    {name}"):
            self.side[name] = (s, self.main[t])
        self.used_on.setdefault(t, set()).add(s)
        if self.rng.random() < 0.5:
            self.emit(f"{t}.record_stream({s})")

    def op_side_alloc(self) -> None:
        if not self.forked:
            return self.op_fork()
        self.make(self.rng.choice(sorted(self.forked)))

    def op_record_free(self) -> None:
        used = sorted(t for t in self.main if t in self.used_on)
        rng = self.rng
        if used:
            t = rng.choice(used)
            for s in sorted(self.used_on.pop(t)):
                self.emit(f"{t}.record_stream({s})")
        elif self.main and rng.random() < 0.3:  # recorded on a stream this capture never forked
            t = rng.choice(sorted(self.main))
            self.emit(f"{t}.record_stream(idle)")
        else:
            return self.op_side_use()
        self.emit(f"del {t}")
        del self.main[t]
        if rng.random() < 0.6:  # the same size again at once: before any join, it cannot be reused
            self.make()

    def op_join(self) -> None:
        if not self.forked:
            return self.op_fork()
        s = self.rng.choice(sorted(self.forked))
        if self.rng.random() < 0.3:
            e = self.fresh().replace("t", "e")
            self.emit(f"{e} = torch.cuda.Event()")
            self.emit(f"{e}.record({s})")
            self.emit(f"torch.cuda.current_stream().wait_event({e})")
        else:
            self.emit(f"torch.cuda.current_stream().wait_stream({s})")
        for _ in range(self.rng.choice((1, 1, 2))):  # allocations after the join: where reuse shows
            self.make()

    def op_side_free(self) -> None:
        """A side-stream tensor read on the capture stream, recorded there, deleted."""
        if not self.side:
            return self.op_side_alloc()
        u = self.rng.choice(sorted(self.side))
        s, n = self.side.pop(u)
        self.emit(f"torch.cuda.current_stream().wait_stream({s})")
        name = self.fresh()
        self.emit(f"{name} = {u} - 1.0")
        self.main[name] = n
        self.emit(f"{u}.record_stream(torch.cuda.current_stream())")
        self.emit(f"del {u}")
        if self.rng.random() < 0.5:
            self.emit(f"{s}.wait_stream(torch.cuda.current_stream())")
            self.make(s)

    def op_free(self) -> None:
        plain = sorted(t for t in self.main if t not in self.used_on)
        if plain:
            t = self.rng.choice(plain)
            self.emit(f"del {t}")
            del self.main[t]

    def op_kernel(self) -> None:
        if self.main:
            self.emit(f"{self.rng.choice(sorted(self.main))}.add_(1.0)")

    OPS = {"op_alloc": 20, "op_fork": 6, "op_side_use": 16, "op_side_alloc": 6, "op_record_free": 16, "op_join": 12,
           "op_side_free": 6, "op_free": 8, "op_kernel": 5}

    def draw(self, steps: int) -> list[str]:
        for _ in range(3):
            self.make()
        names, weights = zip(*self.OPS.items())
        for _ in range(steps):
            getattr(self, self.rng.choices(names, weights)[0])()
        for s in sorted(self.forked):
            self.emit(f"torch.cuda.current_stream().wait_stream({s})")  # every forked stream joins back
        return self.lines


def generate_reuse(seed: int, reuse: bool = True) -> Program:
    """The capture program of ``seed``, with ``graph_capture_record_stream_reuse`` on or off.

    Returns:
        A :class:`Program` of kind ``reuse`` named ``reuse<seed>`` (or ``reuse<seed>_default``),
        the same source either way.
    """
    rng = random.Random(f"graphborrow-reuse-{seed}")
    extra = rng.choice(("", "", "", "expandable_segments:True", "max_split_size_mb:64"))
    streams = rng.choice((1, 1, 2, 3))
    captures = rng.choice((1, 1, 2))
    lines = ["import torch", "", f"torch.manual_seed({seed})",
             "w256, w1024, w2048 = (torch.randn(n, n, device='cuda') for n in (256, 1024, 2048))",
             "warm = w256 @ w256  # cuBLAS makes its handle outside the capture",
             f"{', '.join(f's{i}' for i in range(streams))}, = (torch.cuda.Stream() for _ in range({streams}))",
             "idle = torch.cuda.Stream()", "pool = torch.cuda.graph_pool_handle()", "graphs = []", ""]
    for c in range(captures):
        body = _Body(rng, streams)
        lines.append(f"def body{c}():")
        lines += ["    " + ln for ln in body.draw(rng.randint(12, 40))]
        lines += ["", "", "g = torch.cuda.CUDAGraph()", "with torch.cuda.graph(g, pool=pool):", f"    body{c}()",
                  "graphs.append(g)"]
        if rng.random() < 0.6:
            lines.append("g.replay()")
        lines.append("")
    lines.append("torch.cuda.synchronize()")
    settings = ",".join(x for x in (REUSE if reuse else "", extra) if x)
    name = f"reuse{seed:04d}" + ("" if reuse else "_default")
    return Program(name=name, kind="reuse", source="\n".join(lines) + "\n", settings=settings, seed=seed)
