"""What every ladder of CUDA graphs in one shared pool answers, whatever built the graphs.

A serving engine captures one graph per batch size and pads a step up to the smallest
captured batch that holds it. :class:`Ladder` is that rule and the pool's snapshot; the
synthetic workload (:class:`~graphborrow.workloads.ladder.GraphLadder`) and transformers
models (:class:`~graphborrow.workloads.models.ModelLadder`) build the graphs.
"""

from __future__ import annotations

import contextlib

from graphborrow.core.errors import ParameterError
from graphborrow.sim.cuda_ops import device_queries

__all__ = ["Ladder", "model_code_queries"]


def model_code_queries(backend):
    """What model code asks the device while it runs, answered for ``backend``.

    Args:
        backend: the device the model code runs on.

    Returns:
        A context manager: on the simulated device it answers the CUDA capability query as an
        H200 does; on a GPU it does nothing (the GPU answers).
    """
    if backend.name == "sim":
        return device_queries()
    return contextlib.nullcontext()


class Ladder:
    """Graphs for ``decode_batches`` captured into the pool ``pool_id`` on ``backend``.

    Subclasses set ``backend``, ``state``, ``pool_id`` and ``decode_batches``.
    """

    def graph_batch(self, batch: int) -> int:
        """Smallest captured batch that holds ``batch`` requests (padding up).

        Args:
            batch: requests in the step.

        Returns:
            The captured batch size to replay.

        Raises:
            ParameterError: ``batch`` exceeds the largest captured batch.
        """
        fits = [bs for bs in self.decode_batches if bs >= batch]
        if not fits:
            raise ParameterError(
                f"batch {batch} exceeds the largest captured batch {max(self.decode_batches)}; "
                "capture a larger ladder or split the batch"
            )
        return min(fits)

    def snapshot(self) -> list:
        """The shared pool's segments, where the idle runs are read from.

        Returns:
            Segment dicts in torch's snapshot format, this pool's only.
        """
        return self.backend.memory_snapshot(self.pool_id)
