"""Which source tree's graphborrow a benchmark measures, and two trees' side by side in one process.

A single-tree benchmark calls :func:`put_on_path` before importing graphborrow (``--package
TREE``, else this checkout). :class:`Tree` imports one tree's package under the usual name
while it is active and keeps its modules apart otherwise, so a before/after record can time
an older tree and this one in turns, in one process, on the same inputs::

    before, after = Tree("before", Path("../old")), Tree("after", HERE)
    with before.active():
        before.api.eagle_verify(...)
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parents[1]  # this checkout


def package_tree(argv) -> Path:
    """The tree named by ``--package`` in ``argv``, else this checkout (read before argparse runs)."""
    for i, a in enumerate(argv):
        if a == "--package" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if a.startswith("--package="):
            return Path(a.split("=", 1)[1]).resolve()
    return HERE


def put_on_path(argv) -> Path:
    """Make ``import graphborrow`` find :func:`package_tree`'s package; returns the tree."""
    tree = package_tree(argv)
    sys.path.insert(0, str(tree))
    return tree


def _ours(name: str) -> bool:
    return name == "graphborrow" or name.startswith("graphborrow.")


class Tree:
    """One tree's graphborrow, its modules in ``sys.modules`` only inside :meth:`active`.

    ``api`` holds what the benchmarks call, found under this version's names or an older
    one's (:data:`NAMES`); a name neither version has is None.
    """

    # what the benchmarks call -> (module, attribute) in this version, then in older ones
    NAMES = {
        "eagle_verify": [("graphborrow.eagle", "eagle_verify")],
        "build_draft_tree": [("graphborrow.eagle.draft_tree", "build_draft_tree")],
        "clear_graphs": [("graphborrow.eagle.graphs", "clear_verify_graphs")],
        "graph_steps": [("graphborrow.eagle.graphs", "GRAPH_STEPS")],
        "clear_configs": [("graphborrow.eagle.triton.launch_config", "clear_configs"),
                          ("graphborrow.eagle.triton.fused", "clear_plans")],
        "workspace_bytes": [("graphborrow.eagle.triton.launch_config", "workspace_bytes"),
                            ("graphborrow.eagle.triton.fused", "fused_workspace_bytes")],
        "top_p_renorm": [("graphborrow.eagle.triton.fused_renorm", "top_p_renorm"),
                         ("graphborrow.eagle.triton.select", "top_p_renorm")],
        "top_k_renorm": [("graphborrow.eagle.triton.fused_renorm", "top_k_renorm"),
                         ("graphborrow.eagle.triton.select", "top_k_renorm")],
        "compiled_eager_path": [("graphborrow.eagle.triton.eager_call", "module")],
    }

    def __init__(self, label: str, root: Path):
        self.label, self.root = label, Path(root).resolve()
        if not (self.root / "graphborrow" / "__init__.py").exists():
            raise SystemExit(f"{self.root} holds no graphborrow package (a checkout or `git archive` of one)")
        self.modules: dict = {}
        self.api = None
        with self.active():
            self.api = SimpleNamespace(**{name: self._find(places) for name, places in self.NAMES.items()})

    @staticmethod
    def _find(places):
        for module, attribute in places:
            try:
                return getattr(importlib.import_module(module), attribute)
            except (ImportError, AttributeError):
                continue
        return None

    @contextlib.contextmanager
    def active(self):
        """``import graphborrow`` (and every import inside its code) finds this tree's modules."""
        others = {name: sys.modules.pop(name) for name in [n for n in sys.modules if _ours(n)]}
        sys.modules.update(self.modules)
        sys.path.insert(0, str(self.root))
        importlib.invalidate_caches()
        try:
            yield self.api
        finally:
            sys.path.remove(str(self.root))
            self.modules = {name: sys.modules.pop(name) for name in [n for n in sys.modules if _ours(n)]}
            sys.modules.update(others)
