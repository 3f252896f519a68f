"""A sweep's wait for a Dask scheduler is bounded, and every way of not finding one is said plainly.

The servers here are real sockets on 127.0.0.1: one that accepts and never answers (a firewall,
a proxy, a wrong service), one that answers in another protocol (a web server), and a port
nothing listens on. Dask's connect timeout is set to 1 s, so each refusal comes within seconds.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest
from sweep_notebooks import executions, tiny_notebook

from graphborrow.__main__ import main
from graphborrow.core.errors import ParameterError
from graphborrow.run.sweep import Grid, run_sweep
from graphborrow.run.sweep.cluster import check_scheduler_address, dask_client


@pytest.fixture
def short_connect_timeout():
    import dask
    import distributed  # noqa: F401 - its defaults first: leaving set() would drop those it found missing

    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        yield 1


@contextmanager
def server(answer: bytes | None):
    """A TCP server on a free port that accepts every connection and writes ``answer`` (None: nothing,
    the connection held open) — yields its address."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                try:
                    conn.sendall(answer)
                    conn.close()
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        for conn in held:
            conn.close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


@pytest.mark.parametrize("address, message", [
    ("not an address", "is not HOST:PORT"),
    ("127.0.0.1", "is not HOST:PORT"),
    ("tcp://127.0.0.1:0", "is not HOST:PORT"),
    ("tcp://127.0.0.1:99999", "is not HOST:PORT"),
    ("tcp://127.0.0.1:8786/status", "is not HOST:PORT"),
    ("http://127.0.0.1:8786", "listens on tcp:// (or tls://), not http://"),
    ("inproc://127.0.0.1:8786", "not inproc://"),
])
def test_an_address_of_another_form_is_refused_naming_the_forms(address, message, tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    with pytest.raises(ParameterError) as refused:
        run_sweep(nb, Grid(), out=tmp_path / "out", scheduler=address, progress=False)
    assert message in str(refused.value) and "tcp://HOST:PORT, HOST:PORT or tls://HOST:PORT" in str(refused.value)
    assert executions(nb) == [] and not (tmp_path / "out").exists()


def test_the_accepted_forms_are_kept_with_their_scheme():
    assert check_scheduler_address("10.0.0.5:8786") == "tcp://10.0.0.5:8786"
    assert check_scheduler_address(" tcp://node-3:8786 ") == "tcp://node-3:8786"
    assert check_scheduler_address("tls://[::1]:8786") == "tls://[::1]:8786"


def test_a_server_that_accepts_and_never_answers_is_given_up_on_in_time(short_connect_timeout):
    with server(None) as address:
        start = time.monotonic()
        with pytest.raises(ParameterError, match=f"no Dask scheduler answered at {address} within 1 s"):
            with dask_client(address):
                pass
        assert time.monotonic() - start < 30, "bounded by the connect timeout, not by Dask's defaults"


def test_a_server_that_answers_another_protocol_is_no_scheduler(short_connect_timeout):
    with server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4) as address:
        with pytest.raises(ParameterError, match=f"what answers at {address} is not a Dask scheduler"):
            with dask_client(address):
                pass


def test_a_port_nothing_listens_on_is_unreachable(short_connect_timeout):
    address = closed_port()
    with pytest.raises(ParameterError, match=f"cannot reach the Dask scheduler at {address} "
                                             r"\(ConnectionRefusedError"):
        with dask_client(address):
            pass


def test_the_command_line_exits_2_with_one_line(tmp_path, capsys, short_connect_timeout):
    """No traceback for any of them: one line naming the address, and nothing run or written."""
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    with server(None) as silent, server(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4) as web:
        for address, message in (("not an address", "is not HOST:PORT"), (silent, "no Dask scheduler answered"),
                                 (web, "is not a Dask scheduler"), (closed_port(), "cannot reach")):
            code = main(["sweep", str(nb), "-p", "BATCH_SIZE", "1,2", "--scheduler", address,
                         "--out", str(tmp_path / "out"), "--quiet"])
            err = capsys.readouterr().err
            assert code == 2 and err.startswith("error: ") and message in err, err
            assert "Traceback" not in err
    assert executions(nb) == []
