"""A warm kernel server: a process that has imported what the notebooks import and forks a fresh
Jupyter kernel for each notebook run.

A kernel started from scratch spends seconds importing torch (and, at its first simulated
operation, ``torch._dynamo``), matplotlib and IPython before a notebook's first line runs. This
server pays that once: it imports :data:`WARM_MODULES`, freezes what they made out of the
garbage collector's way, and then answers each request with ``fork()``. The child is a new
process that becomes an ordinary ``ipykernel`` with the request's connection file, folder,
environment and output files, exactly as ``python -m ipykernel_launcher -f FILE`` would; its
namespace is empty, as in any new kernel. Nothing of one notebook run reaches another: each
kernel is its own process, and the server itself never runs notebook code.

What a forked kernel shares with the server, and a kernel started from scratch would make anew:
the modules already imported (imported once, untouched since), Python's string-hash seed, and
the garbage collector's frozen generation. Random state is drawn afresh in each kernel
(Python's ``random`` reseeds itself after a fork; NumPy's global generator is reseeded here).

The client side, which starts servers and hands their kernels to papermill, is
:mod:`graphborrow.run.kernels`. It starts this module as::

    python [the kernel's interpreter options] -m graphborrow.run.kernel_server FD

with ``FD`` one end of a ``SOCK_SEQPACKET`` socket pair. Messages are JSON, one per packet:

- server to client, once: ``{"ready": true, "fork": bool, "why": str, "pid": int}``;
- client to server: ``{"id": n, "argv": [...], "cwd": str, "env": {...}}`` with two file
  descriptors attached (the kernel's stdout and stderr);
- server to client: ``{"id": n, "pid": pid}`` or ``{"id": n, "error": str}``, and
  ``{"exit": pid, "code": code}`` when a kernel ends.

The server ends when the client's end of the socket closes (the client exited or was
killed), killing its kernels first; each kernel is also killed by the kernel (``prctl``) if
the server dies. Kernels run in sessions of their own, so a Ctrl-C in a terminal reaches
neither them nor the server: the client stops them.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import traceback

__all__ = ["WARM_MODULES", "NOT_BEFORE_FORK", "kernel_arguments", "main"]

# What every numbered notebook imports, and what the simulated device imports at its first
# operation (torch._dynamo through torch's meta decompositions, torch.distributed.tensor).
WARM_MODULES = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "matplotlib",
    "matplotlib.pyplot",
    "IPython",
    "IPython.display",
    "ipykernel.ipkernel",
    "ipykernel.kernelapp",
    "graphborrow.core.runs",
    "graphborrow.eagle",
    "graphborrow.planning.capacity",
    "graphborrow.run.results",
    "graphborrow.studies.notebook",
    "graphborrow.studies.plots",
    "graphborrow.studies.measured",
    "graphborrow.workloads.ladder",
)

# Modules that look for a running IPython kernel when they are imported (and set themselves up
# differently without one): importing them here would hand every kernel the wrong set-up.
NOT_BEFORE_FORK = ("ipywidgets", "tqdm.auto", "tqdm.autonotebook", "matplotlib_inline.backend_inline")

INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
MAX_MESSAGE = 1 << 20


def kernel_arguments(argv: list[str]) -> list[str]:
    """The arguments after ``-m ipykernel_launcher`` of a kernel command this server can run.

    A forked kernel runs in this interpreter with this interpreter's options, so the command
    must start with them: ``[sys.executable, *options, "-m", "ipykernel_launcher", ...]``.

    Raises:
        ValueError: another interpreter, other options or another program.
    """
    head = [sys.executable, *_interpreter_options(), "-m", "ipykernel_launcher"]
    if list(argv[:len(head)]) != head:
        raise ValueError(f"this kernel server runs {' '.join(head)} ...; the kernel command is {' '.join(argv)}")
    return list(argv[len(head):])


def _interpreter_options() -> list[str]:
    return [f"-X{k}" if v is True else f"-X{k}={v}" for k, v in sys._xoptions.items()]


def _warm() -> tuple[bool, str]:
    """Import :data:`WARM_MODULES`; whether kernels may be forked from here now, and why not."""
    if not os.environ.get("MPLBACKEND"):
        os.environ["MPLBACKEND"] = INLINE_BACKEND  # what ipykernel sets before any notebook imports matplotlib
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional part (torch without distributed): the kernel imports it itself
            pass
    torch = sys.modules.get("torch")
    if torch is not None and (torch.backends.cuda.is_built() or getattr(torch.version, "hip", None)):
        return False, "a GPU build of torch: CUDA must not meet a fork, so each kernel starts from scratch"
    early = [name for name in NOT_BEFORE_FORK if name in sys.modules]
    if early:
        return False, f"{', '.join(early)} imported before the fork"
    gc.collect()
    gc.freeze()  # imported objects: kept out of every kernel's collections (and its copy-on-write pages)
    return True, ""


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:  # the client is gone; the loop sees it next
        pass


def main(argv: list[str] | None = None) -> int:
    """Serve the client on the socket whose descriptor is ``argv[0]``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle
    server_pid = os.getpid()
    try:
        fork, why = _warm()
    except Exception as exc:  # a broken module: say so, the client starts kernels itself
        fork, why = False, f"{type(exc).__name__}: {exc}"
    _send(sock, {"ready": True, "fork": fork, "why": why, "pid": server_pid})
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup descriptor
    try:
        _serve(sock, fork, children, (wake_r, wake_w), server_pid)
    finally:
        if os.getpid() == server_pid:  # not in a kernel leaving through here
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
    return 0


def _serve(sock: socket.socket, fork: bool, children: set[int], wake: tuple[int, int], server_pid: int) -> None:
    while True:
        ready, _, _ = select.select([sock, wake[0]], [], [])
        if wake[0] in ready:
            os.read(wake[0], 512)
        _reap(sock, children)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except OSError:
            return
        if not data:
            return  # the client closed its end or died
        request = json.loads(data)
        try:
            if not fork:
                raise RuntimeError("this server starts no kernels")
            if len(fds) != 2:
                raise ValueError(f"a request carries the kernel's stdout and stderr, got {len(fds)} descriptors")
            pid = _fork(request, fds, sock, wake, server_pid)
            children.add(pid)
            _send(sock, {"id": request["id"], "pid": pid})
        except Exception as exc:
            _send(sock, {"id": request.get("id"), "error": f"{type(exc).__name__}: {exc}"})
        finally:
            if os.getpid() == server_pid:  # a kernel leaving through here closed them already
                for fd in fds:
                    os.close(fd)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict, fds: list[int], sock: socket.socket, wake: tuple[int, int], server_pid: int) -> int:
    rest = kernel_arguments(request["argv"])
    cwd, env = str(request["cwd"]), dict(request["env"])
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _become_kernel(rest, cwd, env, fds, sock, wake, server_pid)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a kernel that could not start says why in its log
        traceback.print_exc()
    raise SystemExit(code)  # leaves as any Python process does: atexit handlers, flushed streams


def _become_kernel(rest: list[str], cwd: str, env: dict, fds: list[int], sock: socket.socket,
                   wake: tuple[int, int], server_pid: int) -> None:
    """In the child: detach, take the request's streams, folder and environment, run ipykernel."""
    os.setsid()  # a session of its own: interrupts and kills reach the kernel's group only
    _die_with(server_pid)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a kernel's interrupt is a KeyboardInterrupt
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, null), (1, fds[0]), (2, fds[1])):
        os.dup2(fd, target)
    for fd in {null, *fds, *wake}:
        os.close(fd)
    sock.close()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = os.getcwd()  # as `python -m ipykernel_launcher` started in cwd would have it
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # a new kernel's NumPy draws its own global seed
    launcher = importlib.util.find_spec("ipykernel_launcher")
    sys.argv = [launcher.origin if launcher else "ipykernel_launcher", *rest]
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


def _die_with(parent: int) -> None:
    """Have Linux kill this process when ``parent`` ends (and end now if it already has)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:
        os._exit(137)


if __name__ == "__main__":
    sys.exit(main())
