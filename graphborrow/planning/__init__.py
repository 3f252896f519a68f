"""Does a step fit? A step's allocation sequence replayed against an image of the borrow pool
(:mod:`.planner`), and what runs of a given size can hold (:mod:`.capacity`).
"""

__all__: list[str] = []  # the modules are the API: import them by name
