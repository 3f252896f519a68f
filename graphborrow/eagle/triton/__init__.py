"""The fused verification kernels: Triton kernels that read the logits directly, their
probability helpers and the top-k / top-p pivot search.
"""

__all__: list[str] = []  # the modules are the API: import them by name
