"""Simulated device memory: cudaMalloc addresses, including those a recorded GPU run got."""

import pytest
import torch

from graphborrow.allocator.memory import GRANULE, PhysicalMemory
from graphborrow.sim import SimBackend

MiB = 2**20
HIGH = 0x7F8F00000000  # addresses of the kind an H200's driver hands out, above the simulated base


def test_without_a_plan_the_lowest_free_address_is_taken():
    m = PhysicalMemory(capacity=2**30, backed=False)
    a, b = m.cuda_malloc(2 * MiB), m.cuda_malloc(20 * MiB)
    assert (a, b) == (m.base, m.base + 2 * MiB)
    m.cuda_free(a)
    assert m.cuda_malloc(2 * MiB) == a


def test_a_plan_gives_each_size_its_recorded_addresses_in_order():
    m = PhysicalMemory(capacity=2**30, backed=False)
    m.follow_addresses([(2 * MiB, HIGH), (20 * MiB, HIGH - 64 * MiB), (2 * MiB, HIGH + 2 * MiB)])
    assert m.cuda_malloc(20 * MiB) == HIGH - 64 * MiB  # sizes keep their own queues
    assert m.cuda_malloc(2 * MiB) == HIGH
    assert m.cuda_malloc(2 * MiB) == HIGH + 2 * MiB
    assert m.cuda_malloc(2 * MiB) == m.base  # the plan ran out for this size: lowest free address


def test_a_planned_address_still_in_use_is_passed_over():
    m = PhysicalMemory(capacity=2**30, backed=False)
    m.expect_next_address(HIGH)
    assert m.cuda_malloc(2 * MiB) == HIGH
    m.follow_addresses([(2 * MiB, HIGH), (2 * MiB, HIGH + 4 * MiB)])
    assert m.cuda_malloc(2 * MiB) == HIGH + 4 * MiB
    with pytest.raises(ValueError, match="not 2 MiB aligned"):
        m.follow_addresses([(2 * MiB, HIGH + 512)])
    assert GRANULE == 2 * MiB


def test_address_order_decides_which_of_two_equal_free_blocks_is_taken():
    """Why a comparison with a GPU needs its addresses: best fit takes the lower address."""
    homes = []
    for plan in ([(20 * MiB, HIGH), (20 * MiB, HIGH + 64 * MiB)], [(20 * MiB, HIGH + 64 * MiB), (20 * MiB, HIGH)]):
        b = SimBackend(backed=False)
        try:
            b.memory.follow_addresses(plan)
            first = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
            second = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
            made = [b.data_ptr(first), b.data_ptr(second)]
            del first, second
            again = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
            homes.append(made.index(b.data_ptr(again)))  # 0: the first segment made, 1: the second
        finally:
            b.close()
    assert homes == [0, 1]  # the same requests land in the first-made segment or the second
