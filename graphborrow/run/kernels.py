"""Jupyter kernels for notebook runs, forked from a warm kernel server when one can serve them.

:func:`start_kernel` returns a started ``jupyter_client`` kernel manager for papermill to run a
notebook on. Its kernel is a new process either way: forked from a
:mod:`~graphborrow.run.kernel_server` that has imported torch, matplotlib, IPython and graphborrow
once (a kernel ready in a fraction of a second), or started from scratch as Jupyter starts any
kernel. Servers are kept per environment (one for each set of variables their kernels get,
except the per-run Jupyter folders) and per version of graphborrow's sources (an edited source
retires its server), for the life of this process; each ends with it.

A server costs what one kernel's imports cost, once: it pays off for notebooks that import
torch or graphborrow (:func:`wants_warm_kernel`), whose kernels then start in a fraction of a
second. Other notebooks (one that only plots, say) start their kernel from scratch, as do all
kernels when ``GRAPHBORROW_FORK_KERNELS=0``, GPU points, kernels of a GPU build of torch (the
server says so) and kernels a server cannot start or fork.
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Mapping

from graphborrow.core import variables

from .environment import FORK_ENV

try:
    from jupyter_client.provisioning import LocalProvisioner
except ImportError:  # graphborrow without its sweep extra: no Jupyter, no kernels to start here
    LocalProvisioner = object

__all__ = ["FORK_ENV", "KERNELSPEC_NAME", "PER_RUN_VARIABLES", "PROVISIONER_NAME", "ForkProvisioner", "ForkedProcess",
           "KernelServer", "close_servers", "fork_enabled", "install_kernelspec", "kill_kernel", "server_for",
           "start_kernel", "stop_kernel", "wants_warm_kernel"]

# Variables that differ between the runs of one environment: the kernel gets them, the server's
# environment (what the warm imports saw) leaves them out. JPY_PARENT_PID, which jupyter_client
# gives every kernel it starts (and ipykernel reads when it is imported), is this process.
PER_RUN_VARIABLES = ("JUPYTER_RUNTIME_DIR", "JUPYTER_PATH", "JPY_SESSION_NAME", "PYTEST_CURRENT_TEST")
KERNELSPEC_NAME = "graphborrow-forked"
PROVISIONER_NAME = "graphborrow-fork-provisioner"  # the entry point (pyproject.toml) naming ForkProvisioner
READY_SECONDS = 300.0  # the server's imports, on a busy machine
SPAWN_SECONDS = 30.0


def fork_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether kernels may come from a kernel server (``GRAPHBORROW_FORK_KERNELS``, default on)."""
    return variables.read(FORK_ENV, "1", environ) != "0"


# What a notebook may import and still start its kernel from scratch: graphborrow's results files.
LIGHT_MODULES = ("graphborrow.run.results",)


def _imported(notebook: Mapping) -> set[str]:
    names: set[str] = set()
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell.get("source", ""))
        lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
        try:
            tree = ast.parse("\n".join(lines))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a module or a name in one
    return names


def wants_warm_kernel(notebook_source: bytes) -> bool:
    """Whether a notebook imports what a kernel server has imported already: torch, or graphborrow
    beyond its results files. Only then does a forked kernel save more than the server costs."""
    try:
        notebook = json.loads(notebook_source)
    except ValueError:
        return False
    for name in _imported(notebook):
        top = name.split(".")[0]
        if top == "torch" or (top == "graphborrow" and not name.startswith(LIGHT_MODULES)):
            return True
    return False


class ForkedProcess:
    """A kernel forked by a server, with the part of ``subprocess.Popen`` jupyter_client uses."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, server: "KernelServer"):
        self.pid = pid
        self._server = server

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.killpg(self.pid, signum)  # the kernel leads a session of its own
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class KernelServer:
    """One :mod:`~graphborrow.run.kernel_server` process and the kernels it forked for this one."""

    def __init__(self, interpreter: list[str], env: Mapping[str, str], stamp: float):
        self.env, self.stamp = dict(env), stamp
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._errors = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(
                [*interpreter, "-m", "graphborrow.run.kernel_server", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._errors, start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self._ready: dict | None = None
        self._closed = False
        self._next = 0
        threading.Thread(target=self._read, name="graphborrow-kernel-server", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except OSError:
                data = b""
            with self._changed:
                if not data:  # the server ended: its kernels died with it
                    self._closed = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "ready" in message:
                    self._ready = message
                elif "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._replies[message["id"]] = message
                self._changed.notify_all()

    def ready(self, timeout: float = READY_SECONDS) -> tuple[bool, str]:
        """Wait for the server's imports; whether it forks kernels, and why not."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready is not None or self._closed, timeout)
            if self._ready is None:
                return False, self._why_closed() if self._closed else f"not ready after {timeout:.0f} s"
            return bool(self._ready["fork"]), self._ready["why"]

    def _why_closed(self) -> str:
        self._errors.seek(0)
        lines = self._errors.read().decode(errors="replace").strip().splitlines()
        return f"the kernel server exited ({lines[-1] if lines else 'no message'})"

    def spawn(self, argv: list[str], cwd: str, env: Mapping[str, str], stdout: int, stderr: int) -> ForkedProcess:
        """Fork a kernel running ``argv`` (an ``ipykernel_launcher`` command) in ``cwd`` with ``env``.

        Raises:
            RuntimeError: the server cannot fork this kernel (the reason is in the message).
        """
        with self._lock:
            self._next += 1
            ident = self._next
            request = {"id": ident, "argv": list(argv), "cwd": str(cwd), "env": dict(env)}
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [stdout, stderr])
            except OSError as exc:
                raise RuntimeError(f"the kernel server is gone ({exc})") from None
        with self._changed:
            self._changed.wait_for(lambda: ident in self._replies or self._closed, SPAWN_SECONDS)
            reply = self._replies.pop(ident, None)
        if reply is None:
            raise RuntimeError(self._why_closed() if self._closed else "the kernel server did not answer")
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return ForkedProcess(reply["pid"], self)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._closed else None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._closed, timeout)
        return self.exit_code(pid)

    @property
    def alive(self) -> bool:
        return not self._closed and self.process.poll() is None

    def close(self) -> None:
        """End the server and every kernel it still runs."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._sock.close()
        self._errors.close()


_SERVERS: dict[tuple, KernelServer] = {}
_REFUSED: dict[tuple, str] = {}
_SERVERS_LOCK = threading.Lock()


def _source_stamp() -> float:
    """The newest modification time of graphborrow's modules: a server imported an older version."""
    root = Path(__file__).resolve().parents[1]
    return max((p.stat().st_mtime for p in root.rglob("*.py")), default=0.0)


def server_for(argv: list[str], env: Mapping[str, str]) -> tuple[KernelServer | None, str]:
    """The ready server for kernels run by ``argv`` (a kernelspec's command) with ``env``, started
    the first time; or None and why not."""
    head = argv.index("-m") if "-m" in argv else len(argv)
    if argv[head:head + 2] != ["-m", "ipykernel_launcher"]:
        return None, f"the kernel command {' '.join(argv)} does not run ipykernel_launcher"
    interpreter = list(argv[:head])
    warm_env = {k: v for k, v in env.items() if k not in PER_RUN_VARIABLES}
    warm_env["JPY_PARENT_PID"] = str(os.getpid())
    key = (tuple(interpreter), tuple(sorted(warm_env.items())))
    with _SERVERS_LOCK:
        if key in _REFUSED:
            return None, _REFUSED[key]
        stamp = _source_stamp()
        server = _SERVERS.get(key)
        if server is not None and (not server.alive or server.stamp != stamp):
            server.close()
            server = None
        if server is None:
            server = _SERVERS[key] = KernelServer(interpreter, warm_env, stamp)
        fork, why = server.ready()
        if not fork:
            _SERVERS.pop(key).close()
            _REFUSED[key] = why
            return None, why
        return server, ""


def close_servers() -> None:
    """End every kernel server of this process (and their kernels)."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.close()


atexit.register(close_servers)


def _stream_fd(stream, default: int) -> int | None:
    """The descriptor a ``Popen`` stream argument names (None: this process's own), or None for a pipe."""
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return None
    if isinstance(stream, int):
        return stream if stream >= 0 else None
    return stream.fileno()


class ForkProvisioner(LocalProvisioner):
    """jupyter_client's local provisioner, launching the kernel by asking a kernel server to fork it.

    Any Jupyter client uses it through a kernelspec naming it (:func:`install_kernelspec`), or it
    is given to a kernel manager directly (:func:`start_kernel`). A kernel the server cannot
    serve (another command, a GPU build of torch, ``GRAPHBORROW_FORK_KERNELS=0``, a stream that
    is a pipe) starts from scratch, as the local provisioner starts any kernel. ``how`` says which.
    """

    how = ""

    async def launch_kernel(self, cmd: list[str], **kwargs):
        env = {**kwargs.get("env", os.environ), "JPY_PARENT_PID": str(os.getpid())}  # as the launcher sets it
        cwd = kwargs.get("cwd") or os.getcwd()
        out, err = _stream_fd(kwargs.get("stdout"), 1), _stream_fd(kwargs.get("stderr"), 2)
        why = f"{FORK_ENV}=0"
        if fork_enabled(env):
            server, why = server_for(list(cmd), env) if None not in (out, err) else (None, "an output pipe")
            if server is not None:
                try:
                    self.process = server.spawn(cmd, cwd, env, out, err)
                except RuntimeError as exc:
                    why = str(exc)
                else:
                    self.pid = self.pgid = self.process.pid
                    self.cwd, self.how = cwd, "forked"
                    return self.connection_info
        self.how = f"started ({why})"
        return await super().launch_kernel(cmd, **kwargs)


def install_kernelspec(prefix: str | Path | None = None, name: str = KERNELSPEC_NAME) -> Path:
    """Install a kernelspec whose kernels come from a kernel server: this interpreter's ipykernel,
    launched by :class:`ForkProvisioner` (for nbval's ``--nbval-kernel-name``, JupyterLab, ...).

    Args:
        prefix: the environment's prefix (default ``sys.prefix``): the spec goes to
            ``<prefix>/share/jupyter/kernels/<name>``.
        name: the kernelspec's name.

    Returns:
        The folder written.
    """
    folder = Path(prefix or sys.prefix) / "share" / "jupyter" / "kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    options = ["-Xfrozen_modules=off"] if sys.version_info >= (3, 11) else []  # as ipykernel's own spec
    spec = {"argv": [sys.executable, *options, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (graphborrow, forked kernels)", "language": "python",
            "metadata": {"kernel_provisioner": {"provisioner_name": PROVISIONER_NAME}}}
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
    return folder


def start_kernel(kernel_dirs: list[str], kernel_name: str, *, cwd: Path, env: Mapping[str, str], log,
                 runtime_dir: Path, fork: bool = True):
    """A started kernel manager (``jupyter_client``'s asynchronous one, as nbclient expects: it
    watches the kernel while a cell runs) for one notebook run; the caller shuts it down.

    Args:
        kernel_dirs: folders holding the kernelspec ``kernel_name``.
        kernel_name: the kernelspec to run.
        cwd: the kernel's working folder.
        env: the kernel's whole environment.
        log: an open binary file: the kernel's stdout and stderr.
        runtime_dir: where the connection file goes.
        fork: try a kernel server first (:func:`fork_enabled` decides too).

    Returns:
        ``(km, how)``: the ``jupyter_client`` kernel manager and ``"forked"`` or ``"started"``
        (with the reason a server did not serve it).
    """
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_core.utils import run_sync

    km = AsyncKernelManager(kernel_name=kernel_name, kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    km.kernel_id = str(uuid.uuid4())
    km.connection_file = str(runtime_dir / f"kernel-{km.kernel_id}.json")
    if fork:
        km.provisioner = ForkProvisioner(kernel_id=km.kernel_id, kernel_spec=km.kernel_spec, parent=km)
    run_sync(km.start_kernel)(cwd=str(cwd), env=dict(env), stdout=log, stderr=log)
    return km, getattr(km.provisioner, "how", "") or "started"


def kill_kernel(km) -> None:
    """SIGKILL the kernel of ``km`` and everything it started (its session's process group)."""
    pid = getattr(km.provisioner, "pid", None) if km.provisioner is not None else None
    if pid:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_kernel(km) -> None:
    """Kill the kernel (its notebook is done) and remove its connection file."""
    from jupyter_core.utils import run_sync

    deadline = time.monotonic() + 10
    try:
        run_sync(km.shutdown_kernel)(now=True)
    except Exception:  # already gone
        pass
    while km.has_kernel and time.monotonic() < deadline:
        time.sleep(0.05)
