"""Graph ladders in one shared pool: a synthetic Llama-shaped workload (:mod:`.ladder`) and
ladders from transformers models (:mod:`.models`).
"""

__all__: list[str] = []  # the modules are the API: import them by name
