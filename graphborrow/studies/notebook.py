"""What every numbered notebook does first: resolve its preset, then capture a ladder on the device.

    setup = notebook_setup(PRESET, DEVICE, LAYOUT_ONLY, hidden=HIDDEN, ...)   # the shapes, printed
    device = use_device(DEVICE, layout_only=setup.layout_only)              # torch.cuda: a GPU, or the simulated one
    ladder = capture_ladder(setup)

The shapes come from :mod:`graphborrow.studies.presets`; this module adds the parts that need
torch: the synthetic model in the preset's dtype, captured on the device ``torch.cuda`` is
(:func:`graphborrow.use_device` chose it).
"""

from __future__ import annotations

import gc

import torch

from graphborrow.device import get_backend
from graphborrow.device.select import cuda_available
from graphborrow.workloads.ladder import GraphLadder, ModelShape, build_ladder

from .presets import Setup, resolve

__all__ = ["notebook_setup", "model_shape", "capture_ladder", "device_kind"]


def device_kind(device: str) -> str:
    """``"cuda"`` or ``"sim"``: what ``DEVICE`` (``"auto"`` included) means on this machine."""
    if device not in ("auto", "cuda", "sim"):
        raise ValueError(f"DEVICE must be 'auto', 'cuda' or 'sim', got {device!r}")
    return ("cuda" if cuda_available() else "sim") if device == "auto" else device


def notebook_setup(preset: str, device: str, layout_only: bool | None = None, **shapes) -> Setup:
    """The shapes a notebook runs at; prints them, and why an automatic choice came out as it did.

    Args:
        preset: ``PRESET``.
        device: ``DEVICE``: ``"auto"``, ``"cuda"`` or ``"sim"`` (a GPU always has real bytes).
        layout_only: ``LAYOUT_ONLY``: True, False or None (automatic on the simulated device).
        shapes: the shape parameters in lower case (``hidden=HIDDEN``); None takes the preset's.

    Returns:
        The :class:`~graphborrow.studies.presets.Setup`; pass ``setup.layout_only`` to
        :func:`graphborrow.use_device`.

    Before the device opens, what the imports made is moved out of the garbage collector's way
    (``gc.freeze``): a graph capture collects garbage first (``torch.cuda.graph`` does, and so
    does the simulated device), and with torch imported each full collection walked a third of
    a million objects, a third of a second per captured graph. Objects made from here on (every
    tensor, graph and pool of the notebook) are collected as before.
    """
    gc.collect()
    gc.freeze()
    setup = resolve(preset, device_kind(device), layout_only=layout_only, **shapes)
    print(setup.describe())
    for note in setup.notes:
        print(note)
    return setup


def model_shape(setup: Setup) -> ModelShape:
    """The synthetic model's widths and dtype for ``setup``."""
    return ModelShape(hidden=setup.hidden, intermediate=setup.intermediate, layers=setup.layers,
                      vocab=setup.vocab, dtype=getattr(torch, setup.dtype))


def capture_ladder(setup: Setup, model: str = "synthetic", *, ladder=None, prefill_tokens: int | None = None,
                   order: str = "largest_first", seed: int = 0, device=None) -> GraphLadder:
    """Capture the prefill graph and the decode ladder of ``setup`` into one pool.

    Args:
        setup: the shapes.
        model: ``"synthetic"`` or a name of :data:`graphborrow.workloads.models.MODELS` (real
            model code keeps its own widths; ``setup``'s layers, ladder and draft tokens apply).
        ladder: batch sizes to capture instead of ``setup.ladder``.
        prefill_tokens: instead of ``setup.prefill_tokens`` (0: no prefill graph).
        order: ``"largest_first"`` or ``"smallest_first"``.
        seed: seed of the random weights.
        device: the backend to capture on; None for the device ``torch.cuda`` is
            (:func:`graphborrow.use_device`).

    Returns:
        The captured ladder.
    """
    prefill = setup.prefill_tokens if prefill_tokens is None else prefill_tokens
    extra = {"shape": model_shape(setup)} if model == "synthetic" else {}
    return build_ladder(model, device or get_backend("auto"), decode_batches=ladder or setup.ladder,
                        draft_tokens=setup.draft_tokens, prefill_tokens=prefill, layers=setup.layers, order=order,
                        seed=seed, **extra).capture()
