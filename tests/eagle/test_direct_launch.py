"""The direct launcher (graphborrow/eagle/triton/direct.c): built here, packing arguments as
the kernel takes them, refusing what does not fit, and reading Triton's signatures.

A machine without a GPU builds the module and packs arguments; only a launch needs the
driver (there it raises, naming it). The launches themselves, against Triton's launcher and
``CUDAGraph.replay``, are checked on a GPU in test_eager_launch_gpu.py.
"""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from graphborrow.eagle.triton import direct

KINDS = "PiIlLbBhHfderx"


@pytest.fixture(scope="module")
def native():
    module = direct.module()
    assert module is not None, "the direct launcher did not build: " + repr(direct.build())
    return module


def launch(native, kinds, fixed=(), grid=(1, 1, 1)):
    return native.KernelLaunch(0, 0, grid, 128, 0, 0, kinds, tuple(fixed))


def test_every_kind_packs_as_the_kernel_reads_it(native):
    """Each position at its C type's size and encoding (little-endian), per-call positions
    first, fixed ones as given at construction; a constexpr position takes no bytes."""
    values = [2**63 + 5, -7, 2**32 - 1, -2**40, 2**64 - 1, -128, 255, -300, 65535, 0.1, 1e300, 1.5, -2.75, "any"]
    expected = struct.pack("<QiIqQbBhHfde", *values[:12])
    expected += struct.pack("<f", -2.75)[2:]  # bf16: the float32's upper half (truncated, as Triton packs it)
    for per_call in (len(KINDS), 5, 0):
        k = launch(native, KINDS, values[per_call:])
        assert (k.kinds, k.per_call) == (KINDS, per_call)
        assert k.pack(*values[:per_call]) == expected
    k = launch(native, "fi", (3,))
    assert k.pack(2) == struct.pack("<fi", 2.0, 3) and k.pack(True) == struct.pack("<fi", 1.0, 3)


def test_a_launch_writes_only_its_per_call_positions(native):
    k = launch(native, "PlfP", (9, 0))
    assert k.pack(1, 2) == struct.pack("<QqfQ", 1, 2, 9.0, 0)
    assert k.pack(3, -4) == struct.pack("<QqfQ", 3, -4, 9.0, 0)


@pytest.mark.parametrize("kinds,fixed,values,error,message", [
    ("Pi", (), (1,), TypeError, "takes 2 per-call arguments, got 1"),
    ("Pi", (), (1.5, 2), TypeError, "argument 0 .kind 'P'. must be an int, got float"),
    ("Pi", (), (-1, 2), OverflowError, "argument 0 does not fit kind 'P'"),
    ("Pi", (), (1, 2**31), OverflowError, "argument 1 does not fit kind 'i'"),
    ("PB", (), (1, 256), OverflowError, "argument 1 does not fit kind 'B'"),
    ("Pf", (), (1, "x"), TypeError, "argument 1 .kind 'f'. must be a number, got str"),
    ("Ph", (), (1, 2**70), OverflowError, "argument 1 does not fit kind 'h'"),
])
def test_arguments_that_do_not_fit_are_refused_by_position(native, kinds, fixed, values, error, message):
    k = launch(native, kinds, fixed)
    with pytest.raises(error, match=message):
        k.pack(*values)
    with pytest.raises(error, match=message):
        k.launch(*values)  # (checked before the driver is needed)


def test_bad_launches_are_refused_when_made(native):
    with pytest.raises(ValueError, match="unknown argument kind at 1"):
        launch(native, "Pq")
    with pytest.raises(ValueError, match="3 fixed values for 2 argument positions"):
        launch(native, "Pi", (1, 2, 3))
    with pytest.raises(OverflowError, match="argument 1 does not fit kind 'i'"):
        launch(native, "Pi", (1, 2**40))
    with pytest.raises(ValueError, match="grid must be a tuple of three ints"):
        launch(native, "P", grid=(1, 1))
    with pytest.raises(TypeError):
        native.graph_launch(1, 2)
    with pytest.raises(ValueError, match="the graph has no executable"):
        native.graph_launch(0, 0, 0)


def test_a_launch_without_a_usable_driver_raises_naming_it(native):
    """Here (no GPU) the driver library is missing; on a GPU a null kernel handle is refused
    by the driver. Either way a RuntimeError says which."""
    k = launch(native, "P", ())
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1|cuLaunchKernel failed|context current"):
        k.launch(16)


def test_kinds_follow_tritons_types():
    assert direct.kinds_of(["*fp32", "i32", "constexpr", "fp32", "i64", "u1", "*i8", "fp64", "u64", "bf16", "fp16",
                            "i16", "u32", "i8"]) == "PixflBPdLrehIbPP"
    assert direct.kinds_of(["*fp32", ("i32", "i32")]) is None  # tuples: Triton's launcher flattens them
    assert direct.kinds_of(["tensordesc<fp32[16, 16]>"]) is None


PROBE = textwrap.dedent('''
    import json, os
    os.environ["TRITON_INTERPRET"] = "0"
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class CompileOnly:  # what the JIT asks of a driver before it compiles
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(CompileOnly())

    @triton.jit(do_not_specialize=["k"])
    def probe(x, n, scale, one, big, k, flag, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        v = tl.load(x + i, mask=i < n)
        tl.store(x + i, v * scale + one + big + k + flag, mask=i < n)

    kernel = probe.warmup(torch.empty(16), 5, 0.5, 1, 2**40, 1, True, BLOCK=16, grid=(1,))
    print(json.dumps([str(v) for v in kernel.src.signature.values()]))
''')


def test_kinds_of_a_kernel_triton_compiled(tmp_path):
    """Triton's own signature of a kernel compiled for sm_90 (no GPU needed): an int equal to
    1 becomes a constexpr unless told not to specialise, a bool u1 (i1 in older Triton), a Python float fp32,
    a large int i64; the kinds follow, the two scratch pointers last."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    script = tmp_path / "probe.py"  # (Triton reads a kernel's source from its file)
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    signature = json.loads(done.stdout.strip().splitlines()[-1])
    boolean = signature[6]  # (u1 in recent Triton, i1 in older ones)
    assert signature == ["*fp32", "i32", "fp32", "constexpr", "i64", "i32", boolean, "constexpr"]
    assert direct.kinds_of(signature) == "Pifxli" + {"u1": "B", "i1": "b"}[boolean] + "xPP"
