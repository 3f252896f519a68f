"""The simulator against the real allocator: recorded GPU traces replayed event for event, and two
snapshots of the same workload compared block for block.
"""

__all__: list[str] = []  # the modules are the API: import them by name
