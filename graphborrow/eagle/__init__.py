"""EAGLE verification sampling: temperature, softmax, renorm, tree speculative sampling.

One concept per module:

- :mod:`.kernel` — the upstream kernel's semantics (:func:`tree_speculative_sampling_target_only`);
- :mod:`.renorm` — top-k / top-p renormalisation with flashinfer's semantics;
- :mod:`.probs` — the target probabilities' formula, shared bit for bit by both paths;
- :mod:`.step` — the step record (:class:`VerifyStep`) and its device-side parameters;
- :mod:`.validate` — the checks that read values, kept apart so they can be skipped;
- :mod:`.modes` — the reference step's modes (standard, lean, chunked);
- :mod:`.sequence` — the step's allocation sequence, for the capacity planner;
- :mod:`.verify` — :func:`eagle_verify`, the whole step, reference or fused;
- :mod:`.graphs` — ``eagle_verify(..., graph=True)``: steps captured in CUDA graphs on
  first use and replayed after;
- :mod:`.triton` — the Triton kernels: ``fused`` (the step and its per-shape plans),
  ``select`` (top-k / top-p pivots), ``probs`` (the formula as Triton helpers),
  ``launch`` (compiled kernels launched directly), ``workspace`` (one allocation carved
  into slots). Imported only when used (with :mod:`.graphs`): they need triton, and
  select its interpreter on a machine without CUDA.
"""

from .draft_tree import DraftTree, build_draft_tree, tree_from_parents
from .kernel import tree_speculative_sampling_target_only
from .modes import MODES, VerifyResult
from .renorm import top_k_renorm_probs, top_p_renorm_probs
from .scope import BORROW_USER
from .sequence import verify_bytes
from .step import StepShape, VerifyStep
from .verify import IMPLS, eagle_verify, fused_available, resolve_impl

__all__ = [
    "BORROW_USER",
    "IMPLS",
    "MODES",
    "DraftTree",
    "StepShape",
    "VerifyResult",
    "VerifyStep",
    "build_draft_tree",
    "eagle_verify",
    "fused_available",
    "resolve_impl",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "tree_from_parents",
    "tree_speculative_sampling_target_only",
    "verify_bytes",
]
