"""How weightsync stops the processes it starts and says how they ended, in one place: a pod's
rank processes, the trainer pod's command, the vLLM server, and the local runner's pods (and, in
them, that no child outlives its parent, nor a vLLM server's engine and workers their server).

Every stop is the kubelet's: SIGTERM, then SIGKILL to whatever outlasts its grace, and the
process reaped. The graces are seconds between the two signals: STOP_GRACE for a process that
ends at once on SIGTERM (weightsync's own, and a trainer's command, whose stop must fit within the
pod's default 30 s of grace), VLLM_STOP_GRACE for vLLM's server, which shuts its engine down
first.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.process import BaseProcess

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL: a pod's ranks, a trainer's command, the local runner's pods
VLLM_STOP_GRACE = 30.0  # seconds vLLM's server gets to stop after SIGTERM
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies

Proc = subprocess.Popen | BaseProcess


def stop(*procs: Proc, grace: float, group: bool = False) -> None:
    """Stop `procs` (subprocess.Popen or multiprocessing.Process objects): SIGTERM to each that
    runs, SIGKILL to each that outlasts `grace` seconds from then; returns once every one is
    reaped. group: signal each one's whole process group instead (a process started with
    process_group=0 or start_new_session), whose leftovers get SIGKILL even where its leader ended in time."""
    for p in procs:
        _signal(p, signal.SIGTERM, group)
    deadline = time.monotonic() + grace
    for p in procs:
        _wait(p, max(0.0, deadline - time.monotonic()))
    for p in procs:
        if group or _running(p):
            _signal(p, signal.SIGKILL, group)
        _wait(p, None)


def signal_group(pgid: int, sig: int) -> None:
    """`sig` to the process group `pgid`, if any of it is left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _running(p: Proc) -> bool:
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def _signal(p: Proc, sig: int, group: bool) -> None:
    if group:
        signal_group(p.pid, sig)
    elif isinstance(p, subprocess.Popen):
        p.send_signal(sig)  # nothing once the process is reaped
    elif p.is_alive() and sig == signal.SIGKILL:
        p.kill()
    elif p.is_alive():
        p.terminate()


def _wait(p: Proc, timeout: float | None) -> None:
    if isinstance(p, subprocess.Popen):
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    else:
        p.join(timeout)


def exit_status(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it), to follow
    its name. SIGKILL is what the kernel's OOM killer sends (weightsync itself sends it only to
    processes that outlast a SIGTERM while it stops them, or whose parent died), so it is reported
    as the likely cause."""
    if code == -signal.SIGKILL:
        return "was probably out of memory (killed by SIGKILL)"
    return f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def die_with(pid: int) -> bool:
    """This process gets SIGKILL once process `pid` (an ancestor, not necessarily its parent) has
    ended, from a thread of its own that waits on the process's pidfd: at once, not when a
    poll comes round. False where the system has no pidfd (Linux before 5.3, other systems)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGKILL)
        return True
    except (AttributeError, OSError):
        return False

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"weightsync-die-with-{pid}", daemon=True).start()
    return True


def die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies, so no rank outlives its pod process
    (and no local pod its `weightsync run`)."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
