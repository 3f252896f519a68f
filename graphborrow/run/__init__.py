"""What runs the suite: the notebook suite, the demo, results files, parameter sweeps.
"""

__all__: list[str] = []  # the modules are the API: import them by name
