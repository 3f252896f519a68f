"""Differential fuzzing of the simulated device against a GPU with programs model code is made of.

``generate`` draws random programs, ``rules`` and ``probes`` are hand-written ones, the
ordinary model scripts come from :mod:`graphborrow.workloads.plain`; ``record`` runs one on
a GPU, ``run`` on the simulated device and compares, ``corpus`` reads and checks the
recordings committed under ``data/fuzz``.
"""

from .generate import Program, generate

__all__ = ["Program", "generate"]
