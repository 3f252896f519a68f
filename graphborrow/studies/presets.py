"""The shapes a notebook runs at: a named preset, the reader's own values, and whether a CPU
can compute them.

Every numbered notebook has a ``PRESET`` parameter and leaves its shape parameters at None:

- ``"teaching"`` (the default), the one preset of the course: small enough that every notebook
  computes real values on a CPU in seconds, and chosen so that every section shows its effect
  at the defaults (:data:`PRESETS` says which effect each value is for);
- ``"h200"``: the Llama-3-8B shapes measured on the H200 (hidden 4096, intermediate 14336,
  vocabulary 128256, an 8192-token prefill, batch 64 ... 1 at 8 draft tokens).

A value the reader sets wins over the preset's. ``LAYOUT_ONLY = None`` decides by itself: on
the simulated device the notebook runs without bytes (addresses and sizes only) when the
shapes would take more than a few seconds of CPU or more memory than a laptop spares
(:func:`too_large_for_cpu`). The dtype belongs to the preset (float32 for teaching, bfloat16
as served on the H200) and never changes with ``LAYOUT_ONLY``.

This module imports no torch, so checking a sweep's points stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from graphborrow.core.errors import ParameterError

__all__ = ["PRESETS", "SHAPE_NAMES", "Setup", "resolve", "footprint_bytes", "capture_flops",
           "too_large_for_cpu", "BACKED_LIMIT_BYTES", "BACKED_LIMIT_FLOPS"]

# The parameters a preset sets (notebooks spell them in upper case).
SHAPE_NAMES = ("HIDDEN", "INTERMEDIATE", "LAYERS", "VOCAB", "PREFILL_TOKENS", "LADDER", "DRAFT_TOKENS", "BATCH_SIZE")

# The teaching values, and what each is for (checked at the defaults by the notebooks' asserts):
# - prefill 3072 tokens through one 4608-wide MLP: its 108 MiB gate/up intermediate is the pool's
#   largest run, large enough for a precarve (so the largest borrowable tensor is below the run)
#   and for the 32 MiB cuBLAS workspace of notebook 08;
# - GPT-2's 50257-word vocabulary at batch 32 x 8 draft tokens: the standard verification step
#   (two [256, 50257] float32 matrices) does not fit the runs, lean does, and chunked runs it in
#   groups below the whole batch (notebooks 05, 06, 07);
# - decode graphs whose logits stay alive in mixed segments: runs there that the whole-segment
#   rule cannot see (notebook 01), and a run under 2 MiB that can never lend.
PRESETS: dict[str, dict[str, Any]] = {
    "teaching": {"HIDDEN": 256, "INTERMEDIATE": 4608, "LAYERS": 1, "VOCAB": 50257, "PREFILL_TOKENS": 3072,
                 "LADDER": [32, 16, 8, 4, 2, 1], "DRAFT_TOKENS": 8, "BATCH_SIZE": 32, "DTYPE": "float32"},
    "h200": {"HIDDEN": 4096, "INTERMEDIATE": 14336, "LAYERS": 2, "VOCAB": 128256, "PREFILL_TOKENS": 8192,
             "LADDER": [64, 32, 16, 8, 4, 2, 1], "DRAFT_TOKENS": 8, "BATCH_SIZE": 32, "DTYPE": "bfloat16"},
}

# Above these a simulated device with bytes would take more than a few seconds per capture on one
# CPU core (about 25 GFLOP/s in float32) or more host memory than a shared machine spares.
BACKED_LIMIT_BYTES = 768 << 20
BACKED_LIMIT_FLOPS = 150e9


def footprint_bytes(params: Mapping[str, Any]) -> int:
    """A rough upper estimate of the bytes a notebook at ``params`` holds on the device (float32
    weights, the largest graph's activations and logits, and one verification step's
    probabilities); used only to decide whether real bytes are affordable on a CPU.

    Args:
        params: upper-case parameter names; missing ones count at the teaching preset's value.
    """
    get = {**PRESETS["teaching"], **{k: v for k, v in params.items() if v is not None}}.get
    h, i, layers, v = get("HIDDEN"), get("INTERMEDIATE"), get("LAYERS"), get("VOCAB")
    d = max([get("DRAFT_TOKENS")] + list(get("DRAFT_TOKENS_LIST", None) or []))
    top = max(list(get("LADDER") or [1]) + list(get("BATCH_SIZES", None) or []) + [get("BATCH_SIZE") or 1])
    tokens = max(get("PREFILL_TOKENS"), top * d)
    weights = layers * 3 * h * i + h * v
    activations = tokens * (2 * h + 3 * i) + top * d * v * 3
    return 4 * (weights + activations)


def capture_flops(params: Mapping[str, Any]) -> float:
    """Floating-point operations of capturing the synthetic ladder at ``params`` with real values:
    every graph runs twice (warm-up, then capture), its MLP blocks and, for decode graphs, the head.

    Args:
        params: upper-case parameter names; missing ones count at the teaching preset's value.
    """
    get = {**PRESETS["teaching"], **{k: v for k, v in params.items() if v is not None}}.get
    h, i, layers, v = get("HIDDEN"), get("INTERMEDIATE"), get("LAYERS"), get("VOCAB")
    decode_tokens = sum(get("LADDER") or [1]) * get("DRAFT_TOKENS")
    blocks = 2 * layers * 3 * h * i * (get("PREFILL_TOKENS") + decode_tokens)
    head = 2 * h * v * decode_tokens
    return 2.0 * (blocks + head)


def too_large_for_cpu(params: Mapping[str, Any]) -> bool:
    """Whether real bytes at ``params`` would cost a CPU more than seconds or a laptop's memory.

    Args:
        params: upper-case parameter names; missing ones count at the teaching preset's value.
    """
    return footprint_bytes(params) > BACKED_LIMIT_BYTES or capture_flops(params) > BACKED_LIMIT_FLOPS


@dataclass(frozen=True)
class Setup:
    """The shapes one notebook run uses, after the preset, the reader's values and the automatic
    layout-only choice."""

    preset: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    prefill_tokens: int
    ladder: list
    draft_tokens: int
    batch_size: int
    dtype: str
    layout_only: bool
    notes: list = field(default_factory=list)  # why an automatic choice came out as it did

    def params(self) -> dict[str, Any]:
        """The shapes as upper-case parameters (what :func:`too_large_for_cpu` reads)."""
        return {"HIDDEN": self.hidden, "INTERMEDIATE": self.intermediate, "LAYERS": self.layers,
                "VOCAB": self.vocab, "PREFILL_TOKENS": self.prefill_tokens, "LADDER": list(self.ladder),
                "DRAFT_TOKENS": self.draft_tokens, "BATCH_SIZE": self.batch_size}

    def describe(self) -> str:
        """One line: the preset, the shapes, the dtype and whether the run has bytes."""
        return (f"preset {self.preset!r}: hidden {self.hidden}, intermediate {self.intermediate}, {self.layers} "
                f"layer{'s' if self.layers != 1 else ''}, vocabulary {self.vocab}, prefill {self.prefill_tokens} tokens, ladder {self.ladder} x "
                f"{self.draft_tokens} draft tokens, batch {self.batch_size}, {self.dtype}, "
                + ("layout only (no bytes)" if self.layout_only else "real bytes"))


def resolve(preset: str = "teaching", device: str = "sim", *, layout_only: bool | None = None,
            **given: Any) -> Setup:
    """The shapes a notebook runs at.

    Args:
        preset: ``"teaching"`` or ``"h200"``.
        device: where it runs: ``"sim"`` or ``"cuda"`` (``"auto"`` must be resolved by the caller);
            a real device always has bytes.
        layout_only: True, False, or None to decide by :func:`too_large_for_cpu`.
        given: shape values in lower case (``hidden=4096``); None takes the preset's.

    Returns:
        The :class:`Setup`.

    Raises:
        ParameterError: an unknown preset or shape name, a batch no captured graph holds, or
            ``layout_only=True`` on a real device.
    """
    if preset not in PRESETS:
        raise ParameterError(f"PRESET={preset!r} is not a preset; choose one of {list(PRESETS)}")
    unknown = sorted(k for k in given if k.upper() not in SHAPE_NAMES)
    if unknown:
        raise ParameterError(f"{unknown} are not shape parameters; a preset sets {list(SHAPE_NAMES)}")
    values = dict(PRESETS[preset])
    values.update({k.upper(): v for k, v in given.items() if v is not None})
    if given.get("batch_size") is None:  # the preset's batch, within the ladder the reader chose
        values["BATCH_SIZE"] = min(values["BATCH_SIZE"], max(values["LADDER"]))
    if values["BATCH_SIZE"] > max(values["LADDER"]):
        raise ParameterError(f"BATCH_SIZE={values['BATCH_SIZE']} needs a captured graph that large; the largest "
                             f"in LADDER={values['LADDER']} is {max(values['LADDER'])}: raise LADDER or lower BATCH_SIZE")
    notes = []
    if device == "cuda":
        if layout_only:
            raise ParameterError("LAYOUT_ONLY=True applies to the simulated device; a GPU always has bytes "
                                 "(set DEVICE='sim' to run layout-only)")
        layout_only = False
    elif layout_only is None:
        layout_only = too_large_for_cpu(values)
        if layout_only:
            notes.append(f"LAYOUT_ONLY chosen automatically: these shapes need about {footprint_bytes(values) / 2**30:.1f} "
                         f"GiB and {capture_flops(values) / 1e9:.0f} GFLOP per capture, minutes on a CPU; "
                         "the simulated device keeps addresses and sizes only")
    return Setup(preset, values["HIDDEN"], values["INTERMEDIATE"], values["LAYERS"], values["VOCAB"],
                 values["PREFILL_TOKENS"], list(values["LADDER"]), values["DRAFT_TOKENS"], values["BATCH_SIZE"],
                 values["DTYPE"], bool(layout_only), notes)
