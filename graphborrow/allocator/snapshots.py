"""Snapshots in torch's format: the segments and blocks ``torch.cuda.memory_snapshot()`` lists.

:meth:`CachingAllocator.snapshot` calls :func:`segment_infos`; the dicts it builds are what
PyTorch's memory_viz, :mod:`graphborrow.core.snapshot` and the replay read, real or simulated.
"""

from __future__ import annotations

from typing import Any

from .blocks import Block, PrivatePool, Segment

__all__ = ["segment_infos"]


def segment_infos(allocator: Any, only: PrivatePool | None = None) -> list[dict]:
    """The allocator's segments (of one private pool with ``only``) in torch's format, by address.

    An expandable segment appears as one segment per contiguous mapped range. Like torch,
    a range whose first block is free in a private pool that was already deleted (its
    count of device allocations reached 0 while expandable pages stayed mapped) is missing.
    """
    result = []
    for segment in allocator.segments():
        pool = segment.pool
        if only is not None and pool.owner is not only:
            continue
        block = segment.head
        while block is not None:
            if not block.mapped:
                block = block.next
                continue
            reported = block.state != "inactive" or pool.owner is None or allocator.graph_pools.get(
                pool.owner.id) is pool.owner
            info, block = _segment_info(allocator.device, segment, block)
            if reported:  # torch lists free blocks only of pools it still has (see above)
                result.append(info)
    result.sort(key=lambda s: s["address"])
    return result


def _segment_info(device: int, segment: Segment, head: Block) -> tuple[dict, Block | None]:
    """One snapshot segment: the mapped range starting at ``head``; and the block after it."""
    blocks, address = [], head.ptr
    allocated_size = active_size = requested_size = 0
    block = head
    while block is not None and block.mapped:
        state = block.state
        blocks.append({
            "address": address, "size": block.size, "requested_size": block.requested_size,
            "state": state, "frames": [],
        })
        address += block.size
        if state == "active_allocated":
            allocated_size += block.size
        if state != "inactive":
            active_size += block.size
            requested_size += block.requested_size
        block = block.next
    pool = segment.pool
    info = {
        "device": device,
        "address": head.ptr,
        "total_size": address - head.ptr,
        "allocated_size": allocated_size,
        "active_size": active_size,
        "requested_size": requested_size,
        "stream": head.stream,
        "segment_type": "small" if pool.is_small else "large",
        "segment_pool_id": pool.owner_id,
        "is_expandable": segment.expandable,
        "frames": [],
        "blocks": blocks,
    }
    return info, block
