"""What every numbered notebook does first: resolve its preset, open the device, capture a ladder.

    setup, backend = notebook.start("01", PRESET, DEVICE, layout_only=LAYOUT_ONLY, hidden=HIDDEN, ...)
    ladder = notebook.capture(setup, backend)

The shapes come from :mod:`graphborrow.studies.presets`; this module adds the parts that need
torch: the device (CUDA, or the simulated device with or without bytes) and the synthetic model
in the preset's dtype.
"""

from __future__ import annotations

import gc

import torch

from graphborrow.device import get_backend
from graphborrow.device.select import cuda_available
from graphborrow.workloads.ladder import GraphLadder, ModelShape, build_ladder

from .presets import Setup, resolve

__all__ = ["start", "model_shape", "capture", "device_kind"]


def device_kind(device: str) -> str:
    """``"cuda"`` or ``"sim"``: what ``DEVICE`` (``"auto"`` included) means on this machine."""
    if device not in ("auto", "cuda", "sim"):
        raise ValueError(f"DEVICE must be 'auto', 'cuda' or 'sim', got {device!r}")
    return ("cuda" if cuda_available() else "sim") if device == "auto" else device


def start(notebook: str, preset: str, device: str, *, layout_only: bool | None = None, **shapes):
    """Resolve the notebook's shapes and open its device; prints what was chosen and why.

    Args:
        notebook: its number, e.g. ``"01"`` (some notebooks teach at shapes of their own).
        preset: ``PRESET``.
        device: ``DEVICE``: ``"auto"``, ``"cuda"`` or ``"sim"``.
        layout_only: ``LAYOUT_ONLY``: True, False or None (automatic).
        shapes: the shape parameters in lower case (``hidden=HIDDEN``); None takes the preset's.

    Returns:
        ``(setup, backend)``: the :class:`~graphborrow.studies.presets.Setup` and the device.

    Before the device opens, what the imports made is moved out of the garbage collector's way
    (``gc.freeze``): a graph capture collects garbage first (``torch.cuda.graph`` does, and so
    does the simulated device), and with torch imported each full collection walked a third of
    a million objects, a third of a second per captured graph. Objects made from here on (every
    tensor, graph and pool of the notebook) are collected as before.
    """
    gc.collect()
    gc.freeze()
    kind = device_kind(device)
    setup = resolve(preset, kind, notebook, layout_only=layout_only, **shapes)
    backend = get_backend(kind, backed=not setup.layout_only)
    print("device:", backend.describe())
    print(setup.describe())
    for note in setup.notes:
        print(note)
    return setup, backend


def model_shape(setup: Setup) -> ModelShape:
    """The synthetic model's widths and dtype for ``setup``."""
    return ModelShape(hidden=setup.hidden, intermediate=setup.intermediate, layers=setup.layers,
                      vocab=setup.vocab, dtype=getattr(torch, setup.dtype))


def capture(setup: Setup, backend, model: str = "synthetic", *, ladder=None, prefill_tokens: int | None = None,
            order: str = "largest_first", seed: int = 0) -> GraphLadder:
    """Capture the prefill graph and the decode ladder of ``setup`` into one pool on ``backend``.

    Args:
        setup: the shapes.
        backend: the device.
        model: ``"synthetic"`` or a name of :data:`graphborrow.workloads.models.MODELS` (real
            model code keeps its own widths; ``setup``'s layers, ladder and draft tokens apply).
        ladder: batch sizes to capture instead of ``setup.ladder``.
        prefill_tokens: instead of ``setup.prefill_tokens`` (0: no prefill graph).
        order: ``"largest_first"`` or ``"smallest_first"``.
        seed: seed of the random weights.

    Returns:
        The captured ladder.
    """
    prefill = setup.prefill_tokens if prefill_tokens is None else prefill_tokens
    extra = {"shape": model_shape(setup)} if model == "synthetic" else {}
    return build_ladder(model, backend, decode_batches=ladder or setup.ladder, draft_tokens=setup.draft_tokens,
                        prefill_tokens=prefill, layers=setup.layers, order=order, seed=seed, **extra).capture()
