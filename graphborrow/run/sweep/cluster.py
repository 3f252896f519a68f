"""Sweep points on Dask: an embedded local cluster, or an existing one by address.

Each point is one Dask task that runs the notebook with papermill on a worker
(:func:`~graphborrow.run.sweep.execute.execute`: a new kernel per point, forked from the
worker's warm kernel server when the worker runs several points) and returns the executed notebook and its
results as bytes: the client stores them, so workers need no shared file system.

- Without an address, a local cluster of ``workers`` processes (one thread each) starts and
  stops with the sweep.
- ``DEVICE=cuda`` points ask for one ``GPU`` resource, so a worker started with
  ``--resources GPU=1`` runs one of them at a time; an embedded cluster gives each worker a
  GPU of its own through ``CUDA_VISIBLE_DEVICES``.
- A worker that dies mid-point: the scheduler gives the point to another worker; after
  ``distributed.scheduler.allowed-failures`` deaths (3 by default) the point is recorded
  failed with the reason. Points already finished are stored and stay stored. A worker is
  given only as many points as it has threads: the client submits a point only when a
  thread (a GPU, for GPU points) is free, so a death touches only the points that were
  running on it.
- Ctrl-C cancels every pending point; a worker kills the kernel
  of a cancelled point within a second, and an embedded cluster is shut down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import urllib.parse
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from graphborrow.core.errors import ParameterError

from .execute import Execution, NotebookJob, execute

__all__ = ["dask_client", "run_jobs", "run_point_on_worker", "describe_failure", "gpu_for_worker", "free_slots",
           "check_scheduler_address", "ADDRESS_FORMS"]

ADDRESS_FORMS = "tcp://HOST:PORT, HOST:PORT or tls://HOST:PORT (e.g. tcp://10.0.0.5:8786, what 'dask scheduler' prints)"


def check_scheduler_address(address) -> str:
    """The Dask scheduler address to connect to, checked before anything connects.

    Args:
        address: ``tcp://HOST:PORT``, ``HOST:PORT`` (Dask's default scheme, tcp) or ``tls://HOST:PORT``.

    Returns:
        The address with its scheme (``tcp://`` added to a bare ``HOST:PORT``).

    Raises:
        ParameterError: any other form, naming the accepted ones.
    """
    if not isinstance(address, str):
        raise ParameterError(f"scheduler address {address!r} is not text; write {ADDRESS_FORMS}")
    scheme, sep, rest = address.strip().partition("://")
    if not sep:
        scheme, rest = "tcp", address.strip()
    if scheme not in ("tcp", "tls"):
        raise ParameterError(f"scheduler address {address!r}: a Dask scheduler listens on tcp:// (or tls://), "
                             f"not {scheme}://; write {ADDRESS_FORMS}")
    try:
        parts = urllib.parse.urlsplit("//" + rest)
        port = parts.port
    except ValueError:  # a port that is not a number, or past 65535
        parts, port = None, None
    if (parts is None or port is None or port < 1 or not parts.hostname or any(c.isspace() for c in rest)
            or parts.path or parts.query or parts.fragment or parts.username or parts.password):
        raise ParameterError(f"scheduler address {address!r} is not HOST:PORT; write {ADDRESS_FORMS}")
    return f"{scheme}://{rest}"


def _ask_scheduler(address: str, timeout: float) -> None:
    """Connect, shake hands and ask who answers, all within ``timeout`` seconds.

    Dask bounds only the TCP connect: a peer that accepts and never answers (a firewall, a
    proxy, another service) would hold ``Client(...)`` for ever, and one that answers in another
    protocol fails deep inside its reader. Runs on a private event loop in a thread, so it
    works under a running loop too (Jupyter).

    Raises:
        ParameterError: nothing reachable, nothing answered in time, or not a Dask scheduler.
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from distributed.comm import connect
    from distributed.security import Security

    parts = urllib.parse.urlsplit(address)

    async def reach():  # a plain TCP connection first: "nothing there" is another fix than "not Dask"
        _, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.close()

    async def identity():
        comm = await connect(address, timeout=timeout, **Security().get_connection_args("client"))
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    def bounded(step):
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(asyncio.wait_for(step(), timeout))
        finally:
            loop.close()  # does not wait for a name lookup still running in the loop's executor

    def reason(exc: BaseException) -> str:
        first = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__

    with ThreadPoolExecutor(1, thread_name_prefix="graphborrow-scheduler-check") as pool:
        try:
            pool.submit(bounded, reach).result()
        except (asyncio.TimeoutError, TimeoutError, OSError) as exc:
            why = f"within {timeout:.0f} s" if not isinstance(exc, OSError) else f"({reason(exc)})"
            raise ParameterError(
                f"cannot reach the Dask scheduler at {address} {why}; start one with 'dask scheduler' and its "
                "workers with 'dask worker ADDRESS', or leave out --scheduler (scheduler=) to run locally") from None
        try:
            reply = pool.submit(bounded, identity).result()
        except (asyncio.TimeoutError, TimeoutError):
            raise ParameterError(
                f"no Dask scheduler answered at {address} within {timeout:.0f} s: something accepts connections "
                "there but does not answer as Dask does (a firewall, a proxy or another service?); check the "
                "address 'dask scheduler' printed, or wait longer with DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT=120s"
            ) from None
        except Exception as exc:  # noqa: BLE001 - closed on us, or another protocol's bytes read as Dask's
            raise ParameterError(f"what answers at {address} is not a Dask scheduler ({reason(exc)}); check the "
                                 "address and port 'dask scheduler' printed") from None
    kind = reply.get("type") if isinstance(reply, dict) else None
    if kind == "Worker":
        raise ParameterError(f"{address} is a Dask worker, not the scheduler; pass the scheduler's address "
                             "(the worker's log names it: 'Registered to: tcp://...')")
    if kind != "Scheduler":
        raise ParameterError(f"what answers at {address} is not a Dask scheduler (it says it is {kind!r}); "
                             "check the address and port 'dask scheduler' printed")


def gpu_for_worker(name, visible: str | None) -> str:
    """The one GPU a local-cluster worker uses: worker ``i`` gets the ``i``-th visible device.

    Args:
        name: the worker's name (a local cluster numbers them 0, 1, ...).
        visible: the client's ``CUDA_VISIBLE_DEVICES`` (None or empty: all devices, 0, 1, ...).
    """
    index = int(name)
    devices = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if not devices:
        return str(index)
    if index >= len(devices):
        raise ParameterError(f"worker {index} has no GPU of its own: CUDA_VISIBLE_DEVICES={visible} "
                             f"lists {len(devices)}; use fewer workers")
    return devices[index]


def run_point_on_worker(job: NotebookJob, pin_gpu: bool = False) -> Execution:
    """The Dask task: run one point on this worker; stop when its future is cancelled."""
    from distributed import get_worker
    from distributed.worker import thread_state

    worker = get_worker()
    key = getattr(thread_state, "key", None)

    def cancelled() -> bool:
        task = worker.state.tasks.get(key)
        return task is None or task.state in ("cancelled", "released", "forgotten")

    gpu_index = gpu_for_worker(worker.name, os.environ.get("CUDA_VISIBLE_DEVICES")) if pin_gpu and job.gpu else None
    return execute(job, should_stop=cancelled if key is not None else None, worker=worker.address,
                   gpu_index=gpu_index)


def describe_failure(exc: BaseException) -> str:
    """A failed future's reason, in words (a killed worker is the common case)."""
    name = type(exc).__name__
    if name == "KilledWorker":
        return (f"the worker running this point died (killed, out of memory or lost) as many times as "
                f"the scheduler allows (distributed.scheduler.allowed-failures); {exc}")
    if name == "FutureCancelledError":
        return f"the point was cancelled ({exc})"
    return f"the worker could not run the point: {name}: {exc}"


@contextmanager
def _workers_ignore_ctrl_c() -> Iterator[None]:
    """Start worker processes with SIGINT ignored (they inherit it): Ctrl-C in a terminal
    reaches the whole process group, and the client, not each worker, should handle it by
    cancelling the points and closing the cluster."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _quiet_worker_logs():
    """A worker plugin that keeps Dask's logs to CRITICAL in the embedded cluster's workers
    (``silence_logs`` reaches only their nannies): a worker cut off mid-heartbeat by Ctrl-C
    logs a traceback at ERROR, and every failure a user needs comes back as a failed point
    with its reason (:func:`describe_failure`). Restarted workers get it too."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class QuietLogs(WorkerPlugin):
        name = "graphborrow-quiet-logs"

        def setup(self, worker):
            logging.getLogger("distributed").setLevel(logging.CRITICAL)

    return QuietLogs()


@contextmanager
def dask_client(scheduler: str | None = None, workers: int = 1, *, gpu: bool = False) -> Iterator:
    """A connected ``distributed.Client``: to ``scheduler``, or to a local cluster it starts.

    Args:
        scheduler: an address such as ``tcp://10.0.0.5:8786``; None starts a local cluster.
        workers: processes of the local cluster (ignored with a scheduler).
        gpu: some points need a GPU: the local cluster's workers get one each; an existing
            cluster must offer a ``GPU`` resource.

    How long to wait for the scheduler (to connect and to answer) and for its first worker is
    Dask's ``distributed.comm.timeouts.connect`` (30 s by default; environment variable
    ``DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT``).

    Yields:
        The client, with ``client.graphborrow_pin_gpu`` telling whether the workers pin a GPU.
    """
    try:
        from distributed import Client, LocalCluster
    except ImportError as exc:
        raise ParameterError(
            "sweeps run on Dask: install it with pip install 'graphborrow[sweep]' (or distributed)") from exc
    if scheduler:
        import dask
        from dask.utils import parse_timedelta

        scheduler = check_scheduler_address(scheduler)
        connect_timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")
        _ask_scheduler(scheduler, connect_timeout)
        try:
            client = Client(scheduler, timeout=connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise ParameterError(
                f"cannot reach the Dask scheduler at {scheduler} ({exc}); start one with 'dask scheduler' "
                "and its workers with 'dask worker ADDRESS', or leave out --scheduler to run locally") from None
        try:
            try:
                client.wait_for_workers(1, timeout=connect_timeout)
            except TimeoutError:
                raise ParameterError(
                    f"the Dask scheduler at {scheduler} has no workers after {connect_timeout:.0f} s; "
                    "start some with 'dask worker ADDRESS --nthreads 1'") from None
            if gpu:
                offered = [w for w, info in client.scheduler_info()["workers"].items()
                           if info.get("resources", {}).get("GPU", 0) >= 1]
                if not offered:
                    raise ParameterError(
                        f"points with DEVICE=cuda ask for a GPU resource, and no worker of {scheduler} "
                        "offers one; start one worker per GPU with CUDA_VISIBLE_DEVICES=i dask worker "
                        "ADDRESS --nthreads 1 --resources GPU=1")
            client.graphborrow_pin_gpu = False
            yield client
        finally:
            client.close()
        return
    if workers < 1:
        raise ParameterError(f"--workers {workers}: a local cluster needs at least one worker")
    if gpu:
        count = _visible_gpus()
        if count < 1:
            raise ParameterError("points with DEVICE=cuda need a GPU, and torch sees none here; "
                                 "use DEVICE=sim, or --scheduler with GPU workers")
        if workers > count:
            raise ParameterError(f"--workers {workers} but {count} GPU(s) visible: DEVICE=cuda points run "
                                 f"one per GPU; use --workers {count} or fewer")
    import dask

    # No dashboard, and the scheduler's HTTP server (health routes, started even without one) on
    # any free port: the default 8787 warns when another cluster holds it.
    with _workers_ignore_ctrl_c(), dask.config.set({"distributed.scheduler.worker-saturation": 1.0}):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address=None, scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                               silence_logs=logging.CRITICAL, resources={"GPU": 1} if gpu else None)
    try:
        client = Client(cluster)
        try:
            client.register_plugin(_quiet_worker_logs())
            client.graphborrow_pin_gpu = gpu
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def free_slots(client, gpu: bool) -> int:
    """How many points the cluster can run at once: its worker threads, or its GPUs."""
    workers = client.scheduler_info().get("workers", {}).values()
    if gpu:
        return max(1, int(sum(w.get("resources", {}).get("GPU", 0) for w in workers)))
    return max(1, sum(int(w.get("nthreads", 1)) for w in workers))


def run_jobs(client, jobs: Sequence[NotebookJob], on_done: Callable[[int, Execution | None, str | None], None]) -> None:
    """Submit every job; call ``on_done(index, execution, failure)`` as each completes.

    ``failure`` is None when the point ran (its notebook may still have failed: see the
    execution's return code) and the reason in words when the task itself failed. On
    KeyboardInterrupt every unfinished point is cancelled before the interrupt goes on.
    """
    from distributed import as_completed

    pin = bool(getattr(client, "graphborrow_pin_gpu", False))
    index_of = {}
    futures = []
    waiting = list(enumerate(jobs))
    running = 0

    def submit_while_slots_are_free() -> list:
        # The client hands out only as many points as the cluster has threads (GPUs for GPU
        # points): a point still waiting stays here, not queued on a worker that may die.
        nonlocal running
        submitted = []
        slots = {}  # asked of the scheduler once per refill, not once per point
        while waiting:
            gpu = waiting[0][1].gpu
            if gpu not in slots:
                slots[gpu] = free_slots(client, gpu)
            if running >= slots[gpu]:
                break
            i, job = waiting.pop(0)
            future = client.submit(run_point_on_worker, job, pin, key=f"{job.label}-{uuid.uuid4().hex[:8]}",
                                   pure=False, resources={"GPU": 1} if job.gpu else None)
            index_of[future.key] = i
            futures.append(future)
            submitted.append(future)
            running += 1
        return submitted

    try:
        pending = as_completed(submit_while_slots_are_free())
        for future in pending:
            running -= 1
            i = index_of[future.key]
            if future.status == "finished":
                on_done(i, future.result(), None)
            elif future.status == "cancelled":
                on_done(i, None, "the point was cancelled on the cluster before it finished")
            else:
                on_done(i, None, describe_failure(future.exception()))
            pending.update(submit_while_slots_are_free())
    except BaseException:
        client.cancel(futures, force=True)
        raise
