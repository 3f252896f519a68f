"""The fused verification kernels, in Triton: device code and the host configuration that launches it.

Host API: :mod:`.fused` (the verification step), :mod:`.fused_renorm` (the standalone
top-k / top-p renorm), :mod:`.timeline` (the step's own clock). Their configuration:
:mod:`.launch_config` (per-shape launch configurations and their cache), :mod:`.workspace`
(one allocation carved into slots), :mod:`.occupancy` (a persistent grid), :mod:`.runtime`
(triton or its interpreter). Device code: :mod:`.step_kernel`, :mod:`.pivot_search`,
:mod:`.formula`. Every launch goes through Triton's own launcher (``kernel[grid](...)``).
"""

__all__: list[str] = []  # the modules are the API: import them by name
