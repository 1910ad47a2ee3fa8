"""A vLLM server's engine core and workers end with its API server (vllm_backend.follow_server),
shown without vLLM: a process that loads the plugin as vLLM's API server does starts a child as
vLLM starts its engine core and workers (multiprocessing, spawned as vLLM's CPU build does or
forked as on GPUs), and only the parent is killed; and a worker counted away by its job (frozen,
cut off) ends its whole server (vllm_backend.end_server), which then starts again and rejoins.
(With a real vLLM server killed in the middle of a load: test_external_vllm.py; killed between two
versions and restarted: test_vllm_engine.py.)"""

from __future__ import annotations

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


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="this system has no pidfd (Linux 5.3 or later)")
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_the_workers_of_a_server_end_with_its_api_server(tmp_path, method):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        worker = int(server.stdout.readline())
        assert running(worker)
        server.kill()  # the API server alone
        server.wait(10)
        until(f"the {method} worker ending with its server", lambda: not running(worker), 10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        try:
            os.killpg(server.pid, signal.SIGKILL)  # whatever is left, should the test fail
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="this system has no pidfd (Linux 5.3 or later)")
def test_a_worker_counted_away_ends_its_whole_server_so_that_it_starts_again(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = subprocess.Popen([sys.executable, str(script), "spawn", "end"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        worker = int(server.stdout.readline())
        assert server.wait(30) == -signal.SIGTERM  # vLLM's own shutdown, which its pod or its user restarts
        until("the worker ending with its server", lambda: not running(worker), 10)
        said = server.stderr.read()
        assert "the controller counted this rank away at version 3; ending the vLLM server (API process " \
               f"{server.pid}) so that it starts again and its workers rejoin the job" in said, said
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
