"""The staging side of a vLLM worker: where a version waits, received and verified, until the
job's controller has it loaded.

The worker's receiving thread (runtime/inbound.py, the built-in engine's code) receives every
round into the staging buffer while vLLM serves the version before, verifies it, and hands it
over here (offer, runtime/inbound.Handover's side): the worker tells the controller the version
is staged (rendezvous.messages.Staged: its digest, whether vLLM's update session is open) and
waits until the controller had it loaded (loading.py, in vLLM's engine core, between two
scheduler steps), the job ended, the controller counted this rank away, or another worker of its
server failed to load it ahead. A version that failed verification is never offered, so it is
never staged and cannot be loaded. With spec.inference.vllm.loadAhead the version is loaded into
a shadow of the model first, while vLLM serves on (ahead.py), and the load only commits it.

With delta versions (spec.transfer.delta) a worker that receives whole versions has a second
buffer, holding the version loaded: the base the next version's delta is taken against. The two
trade places after every load.

Stage is the one object the receiving thread and vLLM's engine core share: what is staged,
prepared, loaded or failed changes under its lock, through its verbs alone (take, loaded_in,
load_failed, fail), so that each side's waits see every change the other makes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from weightsync.rendezvous.messages import Staged
from weightsync.rendezvous.protocol import Member
from weightsync.runtime.faults import failing_half
from weightsync.runtime.inbound import LoadFailed, StartAgain
from weightsync.transfer.receive import ReceivedVersion, settle_heap
from weightsync.vllm_backend.ahead import Prepared, prepare
from weightsync.vllm_backend.internals import presharded
from weightsync.vllm_backend.placement import Placement

STAGED_CHECK = 1.0  # seconds between a staged rank's looks for the end of the job while it waits to be loaded


def staging_buffers(placement: Placement, device: torch.device) -> list[torch.Tensor]:
    """One staging buffer; with delta versions a second, holding the version loaded (the base).
    A worker of a job whose receivers hold slices gets every version whole, into its local layout."""
    delta = placement.ctx.job.transfer.delta.enabled and placement.local is None
    return [torch.zeros(placement.staging_bytes, dtype=torch.uint8, device=device) for _ in range(2 if delta else 1)]


@dataclass(frozen=True)
class Taken:
    """The staged version as a load takes it: its buffer, and with loadAhead its prepared shadow."""

    buffer: torch.Tensor
    prepared: Prepared | None


class Stage:
    """The staged version and the one loaded, shared by the receiving thread and vLLM's engine core."""

    def __init__(self, placement: Placement, buffers: list[torch.Tensor], member: Member, model: torch.nn.Module,
                 model_config, session_open: Callable[[], bool]):
        self.placement, self.buffers, self.member = placement, buffers, member
        self.model, self.model_config = model, model_config
        self.session_open = session_open  # whether vLLM's update session is open (the engine's)
        self.staging_index = 0  # which buffer receives; with two, the other holds the version loaded
        self.staged: int | None = None
        self.loaded: int | None = None
        self.prepared: Prepared | None = None  # with loadAhead: the staged version, loaded into a shadow
        self.spares: dict = {}  # the last prepared version's kernel tensors, the next prepare's
        self.load_seconds = 0.0  # how long the last load took (the controller's round record shows it)
        self.failed: BaseException | None = None  # the receiving thread's end
        self.load_error: BaseException | None = None  # the staged version's load failed part-way
        self.cond = threading.Condition()

    # inbound.Handover: the receiving thread's side
    def staging(self) -> torch.Tensor:
        return self.buffers[self.staging_index]

    def base(self, version: int | None) -> tuple[int, torch.Tensor] | None:
        with self.cond:
            if len(self.buffers) < 2 or version is None or version != self.loaded:
                return None
            return version, self.buffers[1 - self.staging_index]

    def offer(self, version: int, got: ReceivedVersion) -> float:
        """A verified version is in staging: say so, and wait until the controller had it loaded;
        returns the seconds the load took. With loadAhead the version is loaded into a shadow of
        the model first, while vLLM serves on (the staged record says how long that took)."""
        placement, member = self.placement, self.member
        # a session closed after every load is reported closed: its finish may still be on its way
        opened = bool(self.session_open() and placement.keep_session)
        first = self.loaded is None  # only this thread's offers lead to loads
        prepared = None
        if placement.load_ahead:
            try:
                prepared = prepare(self.model, self.model_config,
                                   failing_half(placement.tensors(self.staging()), placement.rank, version), presharded,
                                   self.spares)
            except Exception as e:  # noqa: BLE001 - the served copy was never touched: the stage is discarded
                raise LoadFailed(f"version {version} failed part-way as it was loaded ahead ({type(e).__name__}: {e}); "
                                 f"the copy vLLM serves was never touched: the stage is discarded, and the server "
                                 f"serves {self.holding()}", self.loaded) from None
        staged = Staged(got.digest, session_open=opened, keep_session=placement.keep_session,
                        prepare_seconds=None if prepared is None else round(prepared.seconds, 6))
        with self.cond:
            self.staged, self.prepared = version, prepared
        member.say_staged(version, staged)
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: self.loaded == version or self.load_error is not None, STAGED_CHECK):
                    if self.load_error is not None:
                        error, self.load_error, self.staged, self.prepared = self.load_error, None, None, None
                        raise LoadFailed(f"vLLM failed part-way through loading version {version} "
                                         f"({type(error).__name__}: {error}): the server holds no whole version and "
                                         "answers its clients 503 until the next version loads whole", None)
                    seconds = self.load_seconds
                    break
            member.check_end()  # the job may end (failed elsewhere) before the load
            if (why := member.away()) is not None:  # frozen or cut off meanwhile: never loaded now
                self._discard()
                raise StartAgain(f"the controller counted this rank away while version {version} waited to be loaded "
                                 f"({why}); ending this process so that it starts again and rejoins")
            if member.unloaded(version):
                self._discard()
                raise LoadFailed(f"another worker of this server failed to load version {version} ahead, so the "
                                 f"server does not load it: the stage is discarded, and it serves {self.holding()}",
                                 self.loaded)
        if first:
            # vLLM serves (it loaded a version): what it made after this engine joined (its
            # profile, KV cache, warm-up) out of the collector's reach too, once. Left in reach,
            # a full collection walks it every few versions (the prepares' objects add up): 0.4 s
            # in this process on a 2-core VM, in which the worker answers no call.
            settle_heap()
        return seconds

    def _discard(self) -> None:
        with self.cond:
            self.staged, self.prepared = None, None

    def holding(self) -> str:
        return f"version {self.loaded}" if self.loaded is not None else "no version of the job's yet"

    def fail(self, error: BaseException) -> None:
        """The receiving thread ended with `error`: nothing is loaded from now on."""
        with self.cond:
            self.failed = error
            self.cond.notify_all()

    # the loading side (loading.py), in vLLM's engine core
    def take(self, version: int) -> Taken:
        """The staged version, where `version` is the one staged and this worker has not failed."""
        with self.cond:
            if self.failed is not None:
                raise RuntimeError(f"{self.placement.me} failed and loads nothing: {self.failed}")
            if self.staged != version:
                raise ValueError(f"{self.placement.me} has version {self.staged} staged, not {version}: nothing was "
                                 "loaded")
            return Taken(self.buffers[self.staging_index], self.prepared)

    def load_failed(self, error: BaseException) -> None:
        """The staged version's load failed part-way: the receiving thread says so (inbound.LoadFailed)."""
        with self.cond:
            self.load_error = error
            self.cond.notify_all()

    def loaded_in(self, version: int, seconds: float) -> None:
        """The staged version is the model's now: the offer returns, and its buffer holds the next base."""
        with self.cond:
            self.loaded, self.staged, self.load_seconds = version, None, seconds
            if self.prepared is not None:
                self.spares, self.prepared = self.prepared.clones, None
            if len(self.buffers) == 2:  # the loaded version stays as the next one's base
                self.staging_index = 1 - self.staging_index
            self.cond.notify_all()
