"""Both devices provide the device API: every method, with the protocol's parameters."""

import inspect

import pytest

from graphborrow.core.device_api import DeviceAPI
from graphborrow.device.cuda import CudaBackend
from graphborrow.sim import SimBackend

ATTRIBUTES = ("name", "device", "backed", "OutOfMemoryError")


def protocol_methods():
    return {name: fn for name, fn in vars(DeviceAPI).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def signature_problems(implementation) -> list[str]:
    """How ``implementation`` (a class) departs from the protocol; empty when it conforms.

    Each protocol method must exist; its parameters must appear in the same order, with
    the same kind and default; the implementation may add parameters only with defaults.
    """
    problems = []
    for name, fn in protocol_methods().items():
        # the implementation's own method: the protocol's documented stub (inherited) does not count
        impl = next((vars(c)[name] for c in implementation.__mro__
                     if c is not DeviceAPI and c is not object and name in vars(c)), None)
        if impl is None or not callable(impl):
            problems.append(f"{name}: missing")
            continue
        want = list(inspect.signature(fn).parameters.values())
        have = list(inspect.signature(impl).parameters.values())
        if [p.name for p in have[:len(want)]] != [p.name for p in want]:
            problems.append(f"{name}{inspect.signature(impl)} != protocol {name}{inspect.signature(fn)}")
            continue
        for w, h in zip(want, have):
            if w.kind != h.kind or w.default != h.default:
                problems.append(f"{name}: parameter {w.name!r} is {h} where the protocol has {w}")
        for extra in have[len(want):]:
            if extra.default is inspect.Parameter.empty and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
                problems.append(f"{name}: extra parameter {extra.name!r} has no default")
    return problems


def test_the_protocol_lists_what_the_project_uses():
    methods = protocol_methods()
    assert len(methods) >= 30
    for name in ("memory_snapshot", "arena_pool", "route_to_pool", "current_stream_key", "external_alloc"):
        assert name in methods


@pytest.mark.parametrize("implementation", [CudaBackend, SimBackend])
def test_both_devices_implement_every_method_with_the_protocols_parameters(implementation):
    assert signature_problems(implementation) == []


def test_both_devices_carry_the_protocols_attributes():
    sim = SimBackend(capacity=2**26, activate=False)
    try:
        assert isinstance(sim, DeviceAPI)
        for name in ATTRIBUTES:
            assert hasattr(sim, name) and hasattr(CudaBackend, name), name
        assert (CudaBackend.name, CudaBackend.device, CudaBackend.backed) == ("cuda", "cuda", True)
        assert (sim.name, sim.device) == ("sim", "cuda")
    finally:
        sim.close()


def test_the_comparison_catches_a_departure():
    class Renamed(SimBackend):
        def memory_snapshot(self, mempool_id=None):  # torch's name, not the protocol's
            return []

    class Required(SimBackend):
        def sleep(self, stream, microseconds, jitter):
            pass

    class Missing:
        pass

    class Inherits(DeviceAPI):  # every method only as the protocol's documented stub
        pass

    assert any(p.startswith("memory_snapshot") for p in signature_problems(Renamed))
    assert any("jitter" in p for p in signature_problems(Required))
    assert len(signature_problems(Missing)) == len(protocol_methods())
    assert len(signature_problems(Inherits)) == len(protocol_methods())


def test_the_contract_is_documented_once_and_inherited():
    """Every protocol method documents itself in DeviceAPI; the real device's wrappers add no copy."""
    import inspect as insp

    for name, fn in protocol_methods().items():
        assert fn.__doc__, f"DeviceAPI.{name} has no docstring: the contract is written down there"
        own = vars(CudaBackend)[name].__doc__
        assert own is None, f"CudaBackend.{name} repeats the contract in its own docstring"
        assert insp.getdoc(getattr(CudaBackend, name)) == insp.getdoc(fn)
