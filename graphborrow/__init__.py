"""graphborrow: borrow the idle free runs of a shared CUDA-graph memory pool.

The package root imports nothing, so ``import graphborrow`` stays cheap and works without
a GPU; the API lives in its modules (``graphborrow.borrow.BorrowState``,
``graphborrow.runs.find_free_runs``, ``graphborrow.backend.get_backend`` ...).
"""

__all__: list[str] = []
