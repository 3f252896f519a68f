"""graphborrow: borrow the idle free runs of a shared CUDA-graph memory pool.

The names most programs start from, loaded when first used (``import graphborrow`` stays
cheap and works without a GPU)::

    from graphborrow import use_device, get_backend, build_ladder, find_free_runs, plan_verify, eagle_verify
    backend = use_device("auto")   # from here on torch.cuda is the GPU, or the simulated device

The layers, bottom to top (a layer imports only those below it; ``tests/test_layers.py``):
``core`` (sizes, snapshots, runs, the arena, the borrow state), ``allocator`` (the model of
PyTorch's caching allocator), ``sim`` (the simulated device), ``device`` (the real device and
the choice), ``planning`` (does a step fit?), ``eagle`` (verification sampling and its plan),
``workloads`` (graph ladders), ``fidelity`` (the simulator against recorded GPU data),
``studies`` (what notebooks show), ``run`` (suite, sweeps, command line).
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "BorrowState": "graphborrow.core.borrow",
    "find_free_runs": "graphborrow.core.runs",
    "load_snapshot": "graphborrow.core.snapshot",
    "get_backend": "graphborrow.device.select",
    "use_device": "graphborrow.device.select",
    "SimBackend": "graphborrow.sim.device",
    "plan_verify": "graphborrow.eagle.plan",
    "eagle_verify": "graphborrow.eagle.verify",
    "build_draft_tree": "graphborrow.eagle.draft_tree",
    "build_ladder": "graphborrow.workloads.ladder",
    "replay_trace": "graphborrow.fidelity.replay",
}

# what the notebooks use of the library: studies, plots, measured tables (graphborrow/studies/exports.py)
_EXPORTS.update(importlib.import_module("graphborrow.studies.exports").NOTEBOOK_EXPORTS)

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphborrow' has no attribute {name!r}")
    module, _, attribute = _EXPORTS[name].partition(":")  # "module:name" where the name there differs
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
