"""A serving-shaped workload: Llama-shaped MLP blocks, a prefill graph and a decode ladder.

Serving engines capture one prefill graph and a ladder of decode graphs (one per batch
size) into a single shared pool, largest first so smaller captures reuse the larger
ones' blocks. Between replays much of that pool is idle: that is what we borrow.

Weights are random (the memory story does not depend on them) and everything runs under
``torch.inference_mode()``: without it autograd keeps activations alive in the pool and
the free runs all but vanish.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import ParameterError
from graphborrow.planning.capacity import largest_borrowable

from .base import Ladder
from .models import MODELS, ModelLadder

__all__ = [
    "LLAMA3_8B",
    "SYNTHETIC",
    "TINY",
    "GraphLadder",
    "LlamaMLP",
    "ModelShape",
    "borrowable_ladder",
    "build_ladder",
    "model_names",
    "notebook_dtype",
]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The widths of the synthetic Llama-shaped model; the defaults are Llama-3-8B's.

    Only shapes matter (weights are random): they set every activation's size, and so the
    pool the graphs are captured into and the idle runs between replays.

    Args:
        hidden: model width (elements per token).
        intermediate: MLP width (the gate and up projections each produce this many).
        layers: number of MLP blocks.
        vocab: vocabulary size, the width of the logits EAGLE verifies.
        dtype: dtype of weights and activations (logits are always float32).

    Raises:
        ParameterError: a width or the layer count is not a positive integer.
    """

    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 2
    vocab: int = 128256
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("hidden", "intermediate", "layers", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParameterError(f"ModelShape.{name} must be a positive integer, got {value!r}")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


LLAMA3_8B = ModelShape()
TINY = ModelShape(hidden=128, intermediate=256, layers=2, vocab=2048, dtype=torch.float32)


class LlamaMLP:
    """RMSNorm → SwiGLU MLP blocks with residuals, then a final norm and the LM head.

    Args:
        shape: the widths.
        device: where the weights live (``backend.device``).
        seed: seed of the random weights.
        fill: fill the weights with values; False on a layout-only device, which has no bytes.
    """

    def __init__(self, shape: ModelShape, device: str = "cuda", seed: int = 0, fill: bool = True):
        self.shape = shape
        g = torch.Generator().manual_seed(seed)
        h, m = shape.hidden, shape.intermediate

        def weight(*size):
            w = torch.empty(*size, dtype=shape.dtype, device=device)
            if fill:  # layout-only devices have no bytes to fill
                w.copy_((torch.randn(*size, generator=g) * size[-1] ** -0.5).to(shape.dtype))
            return w

        self.layers = [
            (weight(h).fill_(1.0), weight(2 * m, h), weight(h, m)) for _ in range(shape.layers)
        ]
        self.norm = weight(h).fill_(1.0)
        self.head = weight(shape.vocab, h)

    @staticmethod
    def _rms_norm(x, w, eps=1e-5):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Run every MLP block (the part a prefill graph captures).

        Args:
            x: activations of shape ``[tokens, hidden]`` in the model's dtype.

        Returns:
            New activations of the same shape.
        """
        for norm, gate_up, down in self.layers:
            gu = F.linear(self._rms_norm(x, norm), gate_up)
            gate, up = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, down)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits, as samplers read them.

        Args:
            x: activations of shape ``[tokens, hidden]``.

        Returns:
            float32 logits of shape ``[tokens, vocab]``: the largest tensor of a decode step.
        """
        return F.linear(self._rms_norm(x, self.norm), self.head).float()


class GraphLadder(Ladder):
    """A prefill graph plus decode graphs for each batch size, in one shared pool.

    Decode graphs take ``batch * draft_tokens`` tokens (EAGLE verifies every draft token)
    and end in the full-vocabulary head, so their logits are the verification input.

    Args:
        backend: the device (see :func:`graphborrow.device.get_backend`).
        shape: the model's widths.
        prefill_tokens: tokens of the prefill graph; 0 captures none.
        decode_batches: the batch sizes to capture a decode graph for.
        draft_tokens: tokens verified per request (each decode graph takes
            ``batch * draft_tokens`` tokens).
        state: the :class:`~graphborrow.core.borrow.BorrowState` whose pool the graphs are captured
            into; None makes one with a new pool handle.
        order: ``"largest_first"`` (as serving engines capture, so smaller graphs reuse the
            larger ones' blocks) or ``"smallest_first"``.
        seed: seed of the random weights.

    Raises:
        ParameterError: a negative ``prefill_tokens``, no or non-positive batch sizes,
            ``draft_tokens`` below 1, or an unknown ``order``.
    """

    def __init__(
        self,
        backend,
        shape: ModelShape = LLAMA3_8B,
        prefill_tokens: int = 8192,
        decode_batches: Sequence[int] = (64, 32, 16, 8, 4, 2, 1),
        draft_tokens: int = 8,
        state: Optional[BorrowState] = None,
        order: str = "largest_first",
        seed: int = 0,
    ):
        if prefill_tokens < 0:
            raise ParameterError(f"prefill_tokens must be >= 0, got {prefill_tokens}")
        if not decode_batches or min(decode_batches) < 1:
            raise ParameterError(f"decode_batches must be positive batch sizes, got {list(decode_batches)}")
        if draft_tokens < 1:
            raise ParameterError(f"draft_tokens must be >= 1, got {draft_tokens}")
        if order not in ("largest_first", "smallest_first"):
            raise ParameterError(f"order must be 'largest_first' or 'smallest_first', got {order!r}")
        self.backend = backend
        self.shape = shape
        self.prefill_tokens = prefill_tokens
        self.draft_tokens = draft_tokens
        self.decode_batches = sorted(set(decode_batches), reverse=(order == "largest_first"))
        self.order = order
        self.state = state if state is not None else BorrowState(backend, pool_id=backend.graph_pool_handle())
        self.pool_id = self.state.pool_id
        with torch.inference_mode():
            self.model = LlamaMLP(shape, device=backend.device, seed=seed,
                                  fill=backend.backed)
        self._warmup_stream = None  # one for all captures: each new stream costs a BLAS workspace
        self.graphs: dict = {}
        self.inputs: dict = {}
        self.outputs: dict = {}

    def _capture(self, key, tokens: int, with_head: bool) -> None:
        b = self.backend
        with torch.inference_mode():
            x = torch.randn(tokens, self.shape.hidden, device=b.device).to(self.shape.dtype)
            if self._warmup_stream is None:
                self._warmup_stream = b.Stream()
            with b.stream(self._warmup_stream):  # warm-up outside the pool (library workspaces, autotuning)
                y = self.model.blocks(x)
                if with_head:
                    y = self.model.logits(y[:1])
                del y
            b.synchronize()
            g = b.CUDAGraph()
            with self.state.capture_scope(), b.graph(g, pool=self.pool_id):
                h = self.model.blocks(x)
                out = self.model.logits(h) if with_head else h
                del h
        self.graphs[key], self.inputs[key], self.outputs[key] = g, x, out

    def capture(self) -> "GraphLadder":
        """Capture prefill (if any) and the decode ladder in the configured order.

        Each capture runs inside the borrow state's capture scope, so a live borrow pool is
        retired first.

        Returns:
            This ladder, so ``GraphLadder(...).capture()`` chains.
        """
        prefill = [("prefill", self.prefill_tokens, False)] if self.prefill_tokens else []
        decode = [(("decode", bs), bs * self.draft_tokens, True) for bs in self.decode_batches]
        plan = prefill + decode if self.order == "largest_first" else decode + prefill
        for key, tokens, head in plan:
            self._capture(key, tokens, head)
        self.backend.synchronize()
        return self

    def capture_decode(self, batch: int) -> torch.Tensor:
        """Capture one more decode graph (e.g. a batch size added later) into the pool.

        Args:
            batch: the batch size (requests; the graph takes ``batch * draft_tokens`` tokens).

        Returns:
            The graph's output logits, ``[batch * draft_tokens, vocab]`` float32; replays write them.

        Raises:
            ParameterError: ``batch`` is below 1.
        """
        if batch < 1:
            raise ParameterError(f"batch must be >= 1, got {batch}")
        self._capture(("decode", batch), batch * self.draft_tokens, True)
        if batch not in self.decode_batches:
            self.decode_batches.append(batch)
        return self.outputs[("decode", batch)]

    def replay(self, key) -> torch.Tensor:
        """Replay one captured graph inside the borrow state's replay scope.

        Args:
            key: ``"prefill"`` or ``("decode", batch)`` for a captured batch size.

        Returns:
            The graph's output tensor (the same one every replay: it is overwritten).

        Raises:
            BorrowLeakError: a borrowed tensor is still referenced; the replay would overwrite it.
        """
        with self.state.replay_scope():
            self.graphs[key].replay()
        return self.outputs[key]

    def decode(self, batch: int) -> torch.Tensor:
        """Replay the decode graph for ``batch`` requests; returns its [bs*D, V] logits.

        Args:
            batch: requests in the step; the smallest captured batch that holds them is replayed.

        Returns:
            The first ``batch * draft_tokens`` rows of that graph's float32 logits (a view
            of its output, overwritten by the next replay).
        """
        bs = self.graph_batch(batch)
        logits = self.replay(("decode", bs))
        return logits[: batch * self.draft_tokens]

    def prefill(self) -> torch.Tensor:
        """Replay the prefill graph.

        Returns:
            Its output activations, ``[prefill_tokens, hidden]`` (overwritten by the next replay).
        """
        return self.replay("prefill")


def notebook_dtype(backend) -> torch.dtype:
    """The synthetic model's dtype on ``backend``: bfloat16 as served on a GPU and on the
    layout-only simulated device (no bytes, so the H200's layout exactly); float32 on a
    simulated device with real bytes, whose CPU kernels are faster and exact in float32.

    Args:
        backend: the device the notebook runs on.

    Returns:
        ``torch.float32`` or ``torch.bfloat16``.
    """
    return torch.float32 if backend.name == "sim" and backend.backed else torch.bfloat16


def borrowable_ladder(ladder: "GraphLadder", fallback: ModelShape | None = None) -> tuple["GraphLadder", str]:
    """``ladder`` if its pool has a run a borrow can use, else a ladder of the teaching shapes.

    A borrow pool carves whole allocator segments (2 MiB at least) out of the runs, so a pool
    of tiny shapes can leave idle runs none of which can hold a borrow. Then the default
    teaching shapes (``fallback``: hidden 256, intermediate 512, vocabulary 4096, prefill 512
    tokens, ladder 16...1, 4 draft tokens, float32) are captured on the same device into a pool of
    their own, and the caller is told why.

    Args:
        ladder: a captured :class:`GraphLadder`.
        fallback: the shape to capture instead; None for the teaching shapes above.

    Returns:
        ``(ladder, note)``: ``note`` is empty when ``ladder`` itself is returned, otherwise
        one sentence saying why the fallback was captured.

    Raises:
        RuntimeError: the fallback ladder has no borrowable run either.
    """
    state = ladder.state
    if any(largest_borrowable(n, state.precarve_sizes([(0, n)])) for _, n in state.free_runs()):
        return ladder, ""
    largest = state.largest_run()
    fallback = fallback or ModelShape(hidden=256, intermediate=512, layers=2, vocab=4096, dtype=torch.float32)
    note = (f"No idle run of this pool can hold a borrow (largest run {largest / 2**20:.2f} MiB; a borrow pool "
            "carves whole segments of 2 MiB or more), so the borrowing below uses a ladder of the default "
            f"shapes (hidden {fallback.hidden}, intermediate {fallback.intermediate}, vocabulary "
            f"{fallback.vocab}, prefill 512 tokens, ladder 16...1, 4 draft tokens) captured into a pool of its own.")
    other = GraphLadder(ladder.backend, fallback, prefill_tokens=512, decode_batches=(16, 8, 4, 2, 1),
                        draft_tokens=4).capture()
    runs = other.state.free_runs()
    if not any(largest_borrowable(n, other.state.precarve_sizes([(0, n)])) for _, n in runs):
        raise RuntimeError(f"the fallback ladder ({fallback}) left no borrowable run either "
                           f"(runs {[n for _, n in runs]}); pass a larger fallback shape")
    return other, note


SYNTHETIC = "synthetic"


def model_names() -> tuple[str, ...]:
    """What a notebook's ``MODEL`` parameter accepts: the synthetic workload, then real configs.

    Returns:
        ``"synthetic"`` followed by the names in :data:`graphborrow.workloads.models.MODELS`.
    """
    return (SYNTHETIC,) + tuple(MODELS)


def build_ladder(
    model: str,
    backend,
    *,
    decode_batches: Sequence[int] = (64, 32, 16, 8, 4, 2, 1),
    draft_tokens: int = 8,
    prefill_tokens: int = 0,
    prefill: Optional[str] = None,
    shape: Optional[ModelShape] = None,
    layers: Optional[int] = None,
    context: int = 1024,
    tiny: Optional[bool] = None,
    state: Optional[BorrowState] = None,
    order: str = "largest_first",
    seed: int = 0,
):
    """A ladder (not yet captured) for a notebook's ``MODEL``: ``"synthetic"`` or a config name.

    Args:
        model: ``"synthetic"`` (:class:`GraphLadder`, the teaching baseline), a name in
            :data:`graphborrow.workloads.models.MODELS`, or any ``transformers`` causal-LM
            configuration object (:class:`graphborrow.workloads.models.ModelLadder`).
        backend: the device (see :func:`graphborrow.device.get_backend`).
        decode_batches: batch sizes of the verify ladder (both workloads).
        draft_tokens: tokens verified per request (both workloads).
        prefill_tokens: tokens of the prefill graph; 0 for none (real models: their
            ``context`` when ``prefill`` asks for one without a length).
        prefill: real models only: ``"none"``, ``"graph"`` or ``"piecewise"``; by default
            ``"graph"`` when ``prefill_tokens`` > 0, else ``"none"``.
        shape: synthetic only (default Llama-3-8B widths); ``layers`` overrides its depth.
        layers: real models: decoder layers (default 2).
        context: real models: cached tokens per request.
        tiny: real models: shrink the widths; by default on a backed simulated device,
            where full widths would compute every matmul on the CPU.
        state: the borrow state whose pool the graphs go into; None makes one.
        order: ``"largest_first"`` or ``"smallest_first"`` capture order.
        seed: seed of the random weights.

    Returns:
        The ladder; call ``.capture()``.

    Raises:
        ParameterError: an unknown ``model``, or an argument the chosen workload does not take.
    """
    if model == SYNTHETIC:
        if prefill not in (None, "none", "graph"):
            raise ParameterError(f"the synthetic workload captures prefill as one graph; prefill={prefill!r}")
        shape = shape or LLAMA3_8B
        if layers is not None:
            shape = dataclasses.replace(shape, layers=layers)
        tokens = 0 if prefill == "none" else prefill_tokens
        return GraphLadder(backend, shape, prefill_tokens=tokens, decode_batches=decode_batches,
                           draft_tokens=draft_tokens, state=state, order=order, seed=seed)
    if shape is not None:
        raise ParameterError(f"shape applies to the synthetic workload only; {model!r} has its own widths")

    if isinstance(model, str):
        if model not in MODELS:
            raise ParameterError(f"unknown MODEL {model!r}; choose one of {list(model_names())}")
        if tiny is None:
            tiny = backend.name == "sim" and backend.backed
    elif tiny is None:
        tiny = False  # a reader's configuration keeps its widths (and ModelLadder refuses tiny=True)
    if prefill is None:
        prefill = "graph" if prefill_tokens else "none"
    return ModelLadder(backend, model, layers=2 if layers is None else layers, decode_batches=decode_batches,
                       draft_tokens=draft_tokens, context=context, prefill=prefill,
                       prefill_tokens=prefill_tokens or None, state=state, order=order, tiny=tiny, seed=seed)
