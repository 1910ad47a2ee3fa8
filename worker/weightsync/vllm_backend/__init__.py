"""weightsync as vLLM's weight-transfer backend "weightsync", registered out of tree.

vLLM loads every `vllm.general_plugins` entry point (pyproject.toml names register below) in each
of its processes before it builds engines, so `--weight-transfer-config '{"backend":
"weightsync"}'` finds the engine with nothing patched in vLLM. register() only names the engine's
module: vLLM imports it in its workers, where it is created. It checks the vLLM it runs in first,
in the server's first process: a vLLM without the weight-transfer API, one whose engine interface
changed, or one that lacks an internal the backend relies on (internals.py) refuses to start on one
line naming what it lacks and the release weightsync is tested with, not left to fail mid-job.

A server the user started joins a job by itself (place.py): register() checks its join variables
first, so that one that cannot join is refused with one line before vLLM loads the model.

On a CPU with AMX tiles, register() asks Linux for the tile state (allow_amx_tiles) in each of
vLLM's processes: vLLM's CPU build runs its bfloat16 attention and MoE kernels on AMX tiles, chosen
by the CPU's flags alone, and never asks; a process that uses a tile without asking dies of
SIGILL. Only oneDNN asks, before its own AMX kernels, so whether a server lived depended on which
kernel its shapes ran first.

A server's engine core and workers end with its API server (follow_server): the controller takes
a server that stopped answering for gone only once its workers' heartbeats stop, and workers that
outlived their server would beat on for seconds with nothing left to load through.

A server of a job whose versions are a LoRA adapter (spec.model.lora) serves it under one name
(WEIGHTSYNC_VLLM_LORA in its environment): register() adds a LoRA resolver (adapter.py) that
answers that name with an adapter loaded from the versions weightsync delivered, never from disk.

Importing this package imports nothing of vLLM or torch (control.py, the controller's client of
the servers' control routes, is plain HTTP).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

from weightsync.job import Env, Lora, SpecError
from weightsync.job.join import Join, JoinEnv
from weightsync.runtime.procs import die_with

BACKEND = "weightsync"
VLLM_TESTED = "0.32.0"  # the release the tests run against (the Makefile's VLLM_VERSION)
# What engine.py implements and calls; a vLLM that lacks any is not one this backend works with.
NEEDED = ("init_transfer_engine", "start_weight_update", "receive_weights", "finish_weight_update", "shutdown",
          "parse_update_info")


SERVER_PID = "WEIGHTSYNC_VLLM_SERVER_PID"  # set by follow_server in the API server, read in its engine and workers
_following = 0  # the pid of the process whose thread follows the server (a forked child has another)

# The ranks vLLM's --max-lora-rank takes (vllm.config.lora.MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class IncompatibleVllm(RuntimeError):
    pass


def max_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM takes that holds an adapter of `rank`."""
    return next(r for r in MAX_LORA_RANKS if r >= rank)


def lora_problem(lora: Lora, enabled: bool, max_rank: int | None) -> str | None:
    """Why a vLLM server (LoRA enabled or not, its --max-lora-rank) cannot serve the job's adapter; None if it can."""
    if not enabled:
        return (f"this job's versions are a LoRA adapter of rank {lora.rank} (spec.model.lora), and this vLLM server "
                f"was started without LoRA: start it with --enable-lora --max-lora-rank {max_lora_rank(lora.rank)}")
    if max_rank is not None and max_rank < lora.rank:
        return (f"this vLLM server's --max-lora-rank {max_rank} is below the adapter's rank {lora.rank} "
                f"(spec.model.lora.rank): start it with --max-lora-rank {max_lora_rank(lora.rank)}")
    return None


def check_vllm() -> str:
    """The running vLLM's version, if it has the weight-transfer API this backend needs and every
    internal of vLLM it relies on (internals.py)."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    advice = (f"weightsync's vLLM backend is tested with vLLM {VLLM_TESTED}; this is vLLM {version}: ")
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:
        raise IncompatibleVllm(advice + f"it has no vllm.distributed.weight_transfer ({e}); "
                               f"use vLLM {VLLM_TESTED}") from None
    missing = [m for m in NEEDED if not hasattr(WeightTransferEngine, m)]
    if missing or not hasattr(WeightTransferEngineFactory, "register_engine"):
        raise IncompatibleVllm(advice + f"its WeightTransferEngine lacks {', '.join(missing) or 'register_engine'}; "
                               f"use vLLM {VLLM_TESTED}")
    from weightsync.vllm_backend.internals import INTERNALS

    _check_internals(INTERNALS, advice)
    return version


def check_trainer_vllm() -> None:
    """The trainer engine's check (integrations/vllm.py, as it is imported): every internal of
    vLLM it relies on (internals.TRAINER); IncompatibleVllm, one line naming what the vLLM lacks."""
    import vllm

    from weightsync.vllm_backend.internals import TRAINER

    _check_internals(TRAINER, f"weightsync's vLLM trainer engine is tested with vLLM {VLLM_TESTED}; this is vLLM "
                              f"{getattr(vllm, '__version__', 'unknown')}: ")


def _check_internals(internals, advice: str) -> None:
    from weightsync.vllm_backend.internals import missing

    lacking = missing(internals)
    if lacking:
        raise IncompatibleVllm(advice + f"it lacks {'; '.join(i.name for i in lacking)}, which weightsync relies on "
                               f"({'; '.join(i.use for i in lacking)}); use vLLM {VLLM_TESTED}")


def joining(environ=os.environ) -> tuple[Join, str] | None:
    """The join variables and the server's URL (job/join.py) where this server joins a job by
    itself; None for a pod's server. SpecError, one line, where they are incomplete: vLLM's
    configuration holds no address of its HTTP server, so only WEIGHTSYNC_VLLM_SERVER says it."""
    join = Join.from_environ(environ)
    if join is None:
        return None
    url = join.vllm_server
    if not url:
        raise SpecError([f"{JoinEnv.VLLM_SERVER} is not set: a vLLM server that joins job {join.job_id} needs its own "
                         "URL as the controller reaches it, for example http://10.0.0.5:8000 (this machine's address "
                         "and the server's --port)"])
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest.strip("/"):
        raise SpecError([f"{JoinEnv.VLLM_SERVER}={url!r}: expected this server's URL as the controller reaches it, "
                         "for example http://10.0.0.5:8000"])
    return join, url.rstrip("/")


def follow_server(environ=os.environ) -> None:
    """In vLLM's API server (the process that runs the server: no multiprocessing parent), note
    its pid in the environment its engine core and workers inherit; in those (vLLM starts them with
    multiprocessing), end this process with SIGKILL as soon as that server process, or this
    process's own multiprocessing parent (a worker's engine core), has ended (runtime/procs.die_with):
    a worker whose engine core died (the OOM killer takes the process that holds the model) would
    otherwise beat on for its rank, in the middle of a load no one will ever use, and its server
    would not be counted away. Called where vLLM loads the plugin and where it builds the engine (a
    forked worker loads no plugin), once per process."""
    global _following
    parent = multiprocessing.parent_process()
    if parent is None:
        environ[SERVER_PID] = str(os.getpid())
        return
    pid = int(environ.get(SERVER_PID) or 0)
    if not pid or _following == os.getpid():
        return
    _following = os.getpid()
    if not all([die_with(pid)] + ([die_with(parent.pid)] if parent.pid and parent.pid != pid else [])):
        print(f"weightsync: this system cannot watch vLLM's API server (pid {pid}, no pidfd): where it dies "
              "alone, this process outlives it", file=sys.stderr, flush=True)


def end_server(why: str, environ=os.environ) -> bool:
    """In a worker of vLLM's server: end the server, its API process first (SIGTERM: vLLM's own
    shutdown, with which its engine core and workers end), so that it starts again (a pod's server:
    its pod restarts it) and its workers rejoin the job, as a rank of the built-in engine does.
    False where the API process is not known (a process vLLM did not start through the plugin)."""
    pid = int(environ.get(SERVER_PID) or 0)
    if not pid:
        return False
    print(f"weightsync: {why}; ending the vLLM server (API process {pid}) so that it starts again and its workers "
          "rejoin the job", file=sys.stderr, flush=True)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def allow_amx_tiles() -> bool:
    """On a CPU with AMX tiles, ask Linux for this process's tile state (arch_prctl
    ARCH_REQ_XCOMP_PERM, through torch's own request); a process forked from this one inherits it,
    one started anew asks again when it loads the plugin. True once granted; False on a CPU without
    tiles, or on a GPU server. Where Linux refuses, it says what follows, and vLLM goes on: a model
    whose kernels need no tiles still serves."""
    from weightsync.vllm_backend.internals import amx_tiles_supported, request_amx_tiles

    if not amx_tiles_supported():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if request_amx_tiles():
        return True
    print("weightsync: this CPU has AMX tiles, and Linux refused this process their state (arch_prctl "
          "ARCH_REQ_XCOMP_PERM; Linux 5.16 or later grants it where the hypervisor enables the tiles): "
          "vLLM's bfloat16 attention and MoE kernels will die of SIGILL", file=sys.stderr, flush=True)
    return False


def register() -> None:
    """The `vllm.general_plugins` entry point."""
    if multiprocessing.parent_process() is None:  # the server's first process: its engine and workers run the same vLLM
        try:
            check_vllm()
        except IncompatibleVllm as e:  # the server's start ends here, with the line alone
            raise SystemExit(f"weightsync: {e}") from None
    allow_amx_tiles()
    try:
        joining()
    except SpecError as e:  # the server's start ends here, with the line alone
        raise SystemExit(f"weightsync: {'; '.join(e.problems)}") from None
    follow_server()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from weightsync.vllm_backend.internals import registered

    if not registered(WeightTransferEngineFactory, BACKEND):  # vLLM runs plugins once per process; be safe
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsync.vllm_backend.engine", "WeightsyncEngine")
    if os.environ.get(Env.VLLM_LORA):  # the server's API process resolves the adapter's name (adapter.py)
        from weightsync.vllm_backend.adapter import register_resolver

        register_resolver(os.environ[Env.VLLM_LORA])
