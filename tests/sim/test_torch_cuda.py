"""Plain ``torch.cuda`` code, as the notebooks write it, on the device ``graphborrow.use_device`` gives.

Every test runs the same code on the simulated device and (marked ``gpu``) on a real GPU, where
``use_device("cuda")`` leaves torch.cuda untouched: what the simulated device answers is what the
GPU answers.
"""

import pickle
import threading

import pytest
import torch

from graphborrow import use_device
from graphborrow.core.arena import BumpArena, library_path
from graphborrow.sim import cuda_api

MiB = 2**20


@pytest.fixture(params=["sim", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not cuda_api.gpu_available(), reason="needs a CUDA device")])])
def device(request):
    backend = use_device(request.param)
    yield backend
    torch.cuda.synchronize()
    if backend.simulated:
        cuda_api.uninstall(cuda_api.installed())
    else:
        torch.cuda.empty_cache()


def warm_up_and_capture(pool, x, w):
    """Warm-up on a side stream, then capture into ``pool`` (torch.cuda.graphs' recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (x @ w).softmax(-1)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        hidden = x @ w
        out = hidden.softmax(-1)
        del hidden
    return g, out


def pool_blocks(pool):
    """``(address, block)`` of every block of ``pool``, addresses from the segment's and the sizes before."""
    found = []
    for s in torch.cuda.memory_snapshot():
        if tuple(s["segment_pool_id"]) == tuple(pool):
            address = s["address"]
            for b in s["blocks"]:
                found.append((address, b))
                address += b["size"]
    return found


def largest_inactive(pool) -> tuple[int, int]:
    """The largest free block of ``pool`` as ``(address, bytes)``."""
    return max(((a, b["size"]) for a, b in pool_blocks(pool) if b["state"] == "inactive"), key=lambda r: r[1],
               default=(0, 0))


def test_a_graph_pool_keeps_its_intermediates_idle_between_replays(device):
    x = torch.randn(256, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    g, out = warm_up_and_capture(pool, x, w)
    g.replay()
    torch.cuda.synchronize()
    states = sorted(b["state"] for _, b in pool_blocks(pool))
    assert "inactive" in states and "active_allocated" in states  # the hidden matrix died inside the capture
    assert tuple(g.pool()) == tuple(pool)
    free, total = torch.cuda.mem_get_info()
    assert 0 < free < total
    del out


def test_a_pluggable_arena_pool_allocates_inside_a_free_run_of_the_graph_pool(device):
    x = torch.randn(512, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    g, out = warm_up_and_capture(pool, x, w)
    torch.cuda.synchronize()
    base, size = largest_inactive(pool)
    assert size >= 2 * MiB
    arena = BumpArena()
    arena.set_extents([(base, size)])
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(library_path()), f"gb_arena_malloc_{arena.slot}",
                                                         f"gb_arena_free_{arena.slot}")
    borrowed = torch.cuda.MemPool(allocator.allocator())
    reserved = torch.cuda.memory_reserved()
    with torch.cuda.use_mem_pool(borrowed):
        t = torch.empty(MiB // 4, device="cuda")
    assert base <= t.data_ptr() < base + size  # the tensor lives in the graph pool's idle bytes
    assert arena.cursor_bytes >= 2 * MiB and torch.cuda.memory_reserved() > reserved  # counted twice
    assert tuple(borrowed.id) in {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()}
    del t
    torch.cuda.synchronize()
    del borrowed
    torch.cuda.empty_cache()
    del out, g


def test_record_stream_keeps_a_freed_block_pending_until_the_stream_catches_up(device):
    side = torch.cuda.Stream()
    t = torch.empty(4 * MiB // 4, device="cuda")
    address = t.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy
        t.mul_(2)
    t.record_stream(side)
    del t

    def state():
        return next(b["state"] for pool in {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()}
                    for a, b in pool_blocks(pool) if a == address)

    assert state() == "active_pending_free"
    torch.cuda.synchronize()
    small = torch.empty(1, device="cuda")  # an allocation processes the completed events
    assert state() == "inactive"
    del small


def test_memory_history_dumps_a_snapshot_memory_viz_reads(device, tmp_path):
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=1000)
    keep = torch.ones(3 * MiB // 4, device="cuda")
    tmp = keep * 2
    del tmp
    path = tmp_path / "dump.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(None)
    data = pickle.loads(path.read_bytes())
    actions = [e["action"] for e in data["device_traces"][torch.cuda.current_device()]]
    assert "alloc" in actions and "free_requested" in actions
    assert any("frames" in e and e["frames"] for e in data["device_traces"][0] if e["action"] == "alloc")
    assert "cudaMalloc" in _memory_viz.trace(data)
    del keep


def test_memory_stats_nested_and_flat_agree_as_torch_flattens_them(device):
    keep = torch.empty(MiB, device="cuda")
    nested = torch.cuda.memory_stats_as_nested_dict()
    flat = torch.cuda.memory_stats()
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] >= 4 * MiB

    def flatten(prefix, value, out):  # torch.cuda.memory.memory_stats' own rule
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{prefix}.{k}" if prefix else k, v, out)
        else:
            out[prefix] = value
        return out

    assert flatten("", nested, {}) == dict(flat)
    assert "PyTorch CUDA memory summary" in torch.cuda.memory_summary()
    del keep


def test_a_thread_started_later_sees_the_device(device):
    seen = {}

    def work():
        t = torch.empty(8, device="cuda")
        seen["device"], seen["stream"] = t.device, torch.cuda.current_stream() == torch.cuda.default_stream()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"device": torch.device("cuda", 0), "stream": True}


def test_deepcopy_of_a_module_is_a_new_allocation_of_the_same_size(device):
    import copy

    model = torch.nn.Linear(512, 512, device="cuda")
    before = torch.cuda.memory_allocated()
    twin = copy.deepcopy(model)
    assert torch.cuda.memory_allocated() - before == 512 * 512 * 4 + 512 * 4
    assert twin.weight.is_cuda and twin.weight.requires_grad and twin.weight.data_ptr() != model.weight.data_ptr()


def test_device_queries_answer_as_an_h200_does(device):
    properties = torch.cuda.get_device_properties(0)
    assert torch.cuda.get_device_capability() == (properties.major, properties.minor)
    assert torch.cuda.get_device_name() == properties.name
    assert torch.cuda.mem_get_info()[1] == properties.total_memory
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1 and torch.cuda.is_initialized()
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
    if device.simulated:
        assert properties.name == "NVIDIA H200" and (properties.major, properties.minor) == (9, 0)
        assert properties.multi_processor_count == device.kernels.multiprocessors == 132


def torch_cuda_functions() -> dict:
    """Every public function and class of torch.cuda, torch.cuda.memory and torch.cuda.graphs, as torch
    defines them (what a script can call)."""
    found = {}
    for module in (torch.cuda, torch.cuda.memory, torch.cuda.graphs):
        for name, value in vars(module).items():
            if (not name.startswith("_") and callable(value) and getattr(value, "__module__", "").startswith("torch.cuda")
                    and not (isinstance(value, type) and issubclass(value, BaseException))
                    and not name.endswith(("Storage", "Tensor"))):
                found[name] = value
    return found


TORCH_CUDA = torch_cuda_functions()


def sample_arguments(name: str):
    """Arguments a script would pass to ``torch.cuda.<name>`` (none for most)."""
    stream = torch.cuda.Stream
    table = {
        "CUDAPluggableAllocator": lambda: (str(library_path()), "gb_arena_malloc_0", "gb_arena_free_0"),
        "StreamContext": lambda: (stream(),), "stream": lambda: (stream(),), "set_stream": lambda: (stream(),),
        "caching_allocator_alloc": lambda: (512,), "caching_allocator_delete": lambda: (torch.cuda.caching_allocator_alloc(512),),
        "can_device_access_peer": lambda: (0, 0), "check_error": lambda: (0,), "device": lambda: (0,),
        "device_of": lambda: (torch.empty(1, device="cuda"),), "graph": lambda: (torch.cuda.CUDAGraph(),),
        "make_graphed_callables": lambda: (torch.nn.Linear(4, 4, device="cuda"),
                                           (torch.randn(2, 4, device="cuda", requires_grad=True),)),
        "manual_seed": lambda: (0,), "manual_seed_all": lambda: (0,), "set_device": lambda: (0,),
        "set_per_process_memory_fraction": lambda: (1.0,), "set_rng_state": lambda: (torch.cuda.get_rng_state(),),
        "set_rng_state_all": lambda: (torch.cuda.get_rng_state_all(),), "set_sync_debug_mode": lambda: (0,),
        "use_mem_pool": lambda: (torch.cuda.MemPool(),),
    }
    return table.get(name, tuple)()


@pytest.mark.parametrize("name", sorted(TORCH_CUDA))
def test_every_torch_cuda_function_answers_or_is_refused_by_name(name):
    """Never torch's 'not compiled with CUDA', a missing torch._C function or a crash."""
    backend = use_device("sim")
    try:
        function = getattr(torch.cuda, name, None) or getattr(torch.cuda.memory, name, None) or \
            getattr(torch.cuda.graphs, name)
        try:
            result = function(*sample_arguments(name))
        except NotImplementedError as exc:
            assert str(exc).startswith(f"torch.cuda.{name} has no answer on the simulated device: ")
            return
        if hasattr(result, "__enter__"):  # a context manager: enter and leave it
            with result:
                pass
        assert function is not TORCH_CUDA[name] or name in ANSWERED_BY_TORCH, f"{name} runs torch's own code"
    finally:
        cuda_api.uninstall(cuda_api.installed())
        del backend


# torch's Python for these works on the simulated device through what the install answers
ANSWERED_BY_TORCH = {"memory_summary", "max_memory_cached", "memory_cached", "reset_max_memory_allocated",
                     "reset_max_memory_cached", "device", "device_of", "get_gencode_flags", "make_graphed_callables",
                     "cudaStatus"}


@pytest.mark.parametrize("layout_only", [False, True], ids=["real-bytes", "layout-only"])
def test_dlpack_export_of_a_simulated_tensor_is_refused_by_name(layout_only):
    """Another library would read memory the simulated device does not have (the interpreter crashed)."""
    use_device("sim", layout_only=layout_only)
    try:
        t = torch.ones(8, device="cuda")
        for export in (lambda: torch.from_dlpack(t), t.__dlpack__, lambda: torch.utils.dlpack.to_dlpack(t)):
            with pytest.raises(BufferError, match="DLPack"):
                export()
        assert torch.from_dlpack(torch.ones(2)).tolist() == [1.0, 1.0]  # host tensors are torch's own
    finally:
        cuda_api.uninstall(cuda_api.installed())
