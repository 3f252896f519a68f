"""EAGLE verification sampling: temperature, softmax, renorm, tree speculative sampling.

One concept per module:

- :mod:`.tree_sampling` — the upstream kernel's semantics (:func:`tree_speculative_sampling_target_only`);
- :mod:`.renorm` — top-k / top-p renormalisation with flashinfer's semantics;
- :mod:`.probs` — the target probabilities' formula, shared bit for bit by both implementations;
- :mod:`.step` — the step record (:class:`VerifyStep`), its result (:class:`VerifyResult`)
  and which implementation runs it (:func:`choose_impl`);
- :mod:`.validate` — the checks that read values, kept apart so they can be skipped;
- :mod:`.modes` — the reference implementation and its modes (standard, lean, chunked);
- :mod:`.sequence` — the step's allocation sequence, for the capacity planner;
- :mod:`.plan` — :func:`~graphborrow.eagle.plan.plan_verify`, the planner's verdict: does a
  step fit the borrowed runs?
- :mod:`.verify` — :func:`eagle_verify`, the whole step, routed to the reference or the fused kernel;
- :mod:`.graphs` — ``eagle_verify(..., graph=True)``: steps captured in CUDA graphs on
  first use and replayed after;
- :mod:`.triton` — the fused kernels (imported only when used, with :mod:`.graphs`: they
  need triton, and select its interpreter on a machine without CUDA).
"""

from .draft_tree import DraftTree, build_draft_tree, tree_from_parents
from .tree_sampling import tree_speculative_sampling_target_only
from .modes import MODES
from .renorm import top_k_renorm_probs, top_p_renorm_probs
from .scope import BORROW_USER
from .sequence import verify_bytes
from .step import IMPLS, StepShape, VerifyResult, VerifyStep, choose_impl, fused_available
from .verify import eagle_verify

__all__ = [
    "BORROW_USER",
    "IMPLS",
    "MODES",
    "DraftTree",
    "StepShape",
    "VerifyResult",
    "VerifyStep",
    "build_draft_tree",
    "choose_impl",
    "eagle_verify",
    "fused_available",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "tree_from_parents",
    "tree_speculative_sampling_target_only",
    "verify_bytes",
]
