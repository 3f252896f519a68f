"""What the notebooks show: capacity and pool studies, snapshot inspection, hazards, deferred frees,
the H200's measured numbers, the explorer and the plots.
"""

__all__: list[str] = []  # the modules are the API: import them by name
