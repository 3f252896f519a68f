"""The core: the allocator's size rules, snapshots and their free runs, the C bump arena, the borrow state and its scopes.

Nothing here imports another layer; everything else builds on it.
"""

__all__: list[str] = []  # the modules are the API: import them by name
