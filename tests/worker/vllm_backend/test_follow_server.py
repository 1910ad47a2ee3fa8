"""A vLLM server's engine core and workers end with its API server, and its workers with their
engine core (vllm_backend.follow_server),
shown without vLLM: a process that loads the plugin as vLLM's API server does starts a child as
vLLM starts its engine core and workers (multiprocessing, spawned as vLLM's CPU build does or
forked as on GPUs), and only the parent is killed; and a worker counted away by its job (frozen,
cut off) ends its whole server (vllm_backend.end_server), which then starts again and rejoins.
(With a real vLLM server killed between two versions and restarted: test_vllm_engine.py; its
engine core killed in the middle of a load: test_external_vllm.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.waits import until

SERVER = """
import multiprocessing, os, sys, time
from weightsync.vllm_backend import end_server, follow_server

def worker(pids, told, end):
    follow_server()  # where vLLM loads the plugin in its engine core, or builds a worker's engine
    pids.put(os.getpid())
    if end and told.wait(60):  # the worker found that its job counted it away
        assert end_server("the controller counted this rank away at version 3")
    time.sleep(300)

if __name__ == "__main__":
    follow_server()  # the API server's own process
    context = multiprocessing.get_context(sys.argv[1])
    pids, told = context.Queue(), context.Event()
    context.Process(target=worker, args=(pids, told, sys.argv[2:] == ["end"])).start()
    print(pids.get(timeout=60), flush=True)
    told.set()
    time.sleep(300)
"""


def running(pid: int) -> bool:
    """Whether `pid` runs (an orphan that ended is a zombie until whoever adopted it reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def started(tmp_path, script: str, *args: str, **popen):
    """`script` run as a server's API process in a session of its own; it and whatever it left are
    killed at the end, should the test fail."""
    path = tmp_path / "server.py"
    path.write_text(script)
    server = subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE, text=True,
                              start_new_session=True, **popen)
    try:
        yield server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="this system has no pidfd (Linux 5.3 or later)")
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_the_workers_of_a_server_end_with_its_api_server(tmp_path, method):
    with started(tmp_path, SERVER, method) as server:
        worker = int(server.stdout.readline())
        assert running(worker)
        server.kill()  # the API server alone
        server.wait(10)
        until(f"the {method} worker ending with its server", lambda: not running(worker), 10)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="this system has no pidfd (Linux 5.3 or later)")
def test_a_worker_counted_away_ends_its_whole_server_so_that_it_starts_again(tmp_path):
    with started(tmp_path, SERVER, "spawn", "end", stderr=subprocess.PIPE) as server:
        worker = int(server.stdout.readline())
        assert server.wait(30) == -signal.SIGTERM  # vLLM's own shutdown, which its pod or its user restarts
        until("the worker ending with its server", lambda: not running(worker), 10)
        said = server.stderr.read()
        assert "the controller counted this rank away at version 3; ending the vLLM server (API process " \
               f"{server.pid}) so that it starts again and its workers rejoin the job" in said, said


ENGINE = """
import json, multiprocessing, os, sys, time
from weightsync.vllm_backend import follow_server

def worker(pids):
    follow_server()
    pids.put(("worker", os.getpid()))
    time.sleep(300)

def engine(pids):
    follow_server()  # vLLM's engine core, whose workers it starts
    multiprocessing.get_context(sys.argv[1]).Process(target=worker, args=(pids,)).start()
    pids.put(("engine", os.getpid()))
    time.sleep(300)

if __name__ == "__main__":
    follow_server()
    context = multiprocessing.get_context(sys.argv[1])
    pids = context.Queue()
    context.Process(target=engine, args=(pids,)).start()
    print(json.dumps(dict(pids.get(timeout=60) for _ in range(2))), flush=True)
    time.sleep(300)
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="this system has no pidfd (Linux 5.3 or later)")
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_worker_ends_with_its_engine_core_while_the_api_server_lives_on(tmp_path, method):
    with started(tmp_path, ENGINE, method) as server:
        pids = json.loads(server.stdout.readline())
        assert running(pids["worker"]) and running(pids["engine"])
        os.kill(pids["engine"], signal.SIGKILL)  # the engine core alone, as the OOM killer takes it
        until(f"the {method} worker ending with its engine core", lambda: not running(pids["worker"]), 10)
        assert server.poll() is None, "the API server ended too"
