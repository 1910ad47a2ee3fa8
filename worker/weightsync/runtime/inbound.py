"""An inference rank's side of every round, whatever engine runs its model: receive the version
into staging, verify it, hand it to the engine, report it applied.

The built-in engine (roles/inference.py) and vLLM's workers (vllm_backend/staging.py) differ only in how a
verified version reaches the model: the built-in one points its parameters at the staging buffer
between two generations, vLLM loads it between two scheduler steps when the controller says so.
Both take it through the same Handover, so a version that fails verification never reaches either
and the checks are one piece of code. So is what follows a load that fails part-way (LoadFailed):
the engine is back on its last whole version, or serves none, and the rank either says so and
goes on (spec.inference.onLoadFailure rollBack: the controller counts it behind and sends it the
next version whole) or fails the job.

A rank whose process started again (its pod restarted) is taken back at the next round, which it
receives in full. A rank the controller counted away (silent, or cut off by the trainers) while its
process lived on ends its process, so that it starts again and rejoins the same way. A round the
controller dropped (a trainer rank stopped while it was on its way, and the trainers resume from
their checkpoint) is left half received: never verified, never handed to the engine, and the rank
waits for the next version on the weights it serves.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Protocol

from weightsync.job import INFERENCE, Job, reasons
from weightsync.job.role_sections import FAIL_JOB, ROLL_BACK
from weightsync.rendezvous.following import Dropped, FellBehind
from weightsync.rendezvous.messages import Applied, End, Round
from weightsync.rendezvous.protocol import HEARTBEAT, JobEnded, Keys, Member, who
from weightsync.runtime.faults import pause_point
from weightsync.runtime.metrics import rank_counters
from weightsync.runtime.rank import Expected, log
from weightsync.transfer.receive import ReceivedVersion, VersionReceiver
from weightsync.transport.base import ChecksumMismatch, TransferError

# seconds a rank whose receive failed waits for the controller to say whether a trainer rank
# stopped and the round is dropped: the controller sees a stopped trainer within its silent limit
# (8 s at most) and a few heartbeats to blame the right rank
VERDICT_WAIT = 8.0 + 8 * HEARTBEAT


class VerificationError(Expected):
    """A version's digest is not the one the trainers sent: it is never applied (counted where
    it is found)."""

    reason = reasons.VERIFICATION_FAILED


class LoadFailed(Expected):
    """The engine failed part-way through loading a verified version. It never serves half of two
    versions: `holds` is the version it went back to, loaded whole and verified (None: it holds no
    whole version, and serves none until the next one loads whole). With spec.inference.onLoadFailure
    rollBack the rank says so and takes the next round, which it receives whole; with failJob it
    fails (reason LoadFailed)."""

    reason = reasons.LOAD_FAILED

    def __init__(self, message: str, holds: int | None):
        super().__init__(message)
        self.holds = holds


class StartAgain(Expected):
    """This rank's process must end so that it starts again and rejoins the job (its pod restarts
    it); not a failure of the job."""


class Handover(Protocol):
    """Where an engine takes versions: the buffer to receive into, the version it can take a delta
    against, and the hand-over of a verified version (returns once the model runs on it, with the
    seconds its load took where the engine loads it, None where the model runs on staging itself;
    or raises why it cannot)."""

    def staging(self): ...

    def base(self, version: int | None): ...

    def offer(self, version: int, got: ReceivedVersion) -> float | None: ...


class GenerationHandover:
    """The hand-over between the receiving thread and an engine's generation loop in one
    process (the built-in engines): the thread offers a verified version and waits until the loop
    runs on it; the loop waits for an offer or the end, between two generations. Subclasses say
    where versions land (staging, base) and how the loop takes one."""

    def __init__(self):
        self.version: int | None = None  # the version the model runs on
        self.staged: int | None = None
        self.end: End | None = None
        self.error: BaseException | None = None
        self.load_error: tuple[int, BaseException] | None = None  # the version whose load failed, and why
        self.cond = threading.Condition()

    # the receiving thread
    def offer(self, version: int, got: ReceivedVersion | None = None) -> None:
        """Hand over the version in staging and wait until the model runs on it (nothing is loaded:
        the model's parameters point at the buffer); LoadFailed where the loop could not switch to
        it and went back to the version it ran."""
        with self.cond:
            self.staged = version
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.staged is None or self.error is not None)
            failed, self.load_error = self.load_error, None
        if failed is not None and failed[0] == version:
            back = f"the model runs on version {self.version} again" if self.version is not None else \
                "the model serves no version until one loads whole"
            raise LoadFailed(f"version {version} failed to load part-way ({type(failed[1]).__name__}: {failed[1]}); "
                             f"{back}", self.version)

    def finish(self, end: End | None = None, error: BaseException | None = None) -> None:
        with self.cond:
            self.end, self.error = end, error
            self.cond.notify_all()

    # the generation loop
    def next_event(self, timeout: float | None) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.staged is not None or self.end is not None or self.error is not None, timeout)

    def start_receiving(self, member: Member, receiver: VersionReceiver, job: Job) -> threading.Thread:
        """Start the receiving thread, the only user of the member's store client from then on: it
        takes every round and hands the job's end, or why it failed, to the generation loop."""
        def receive() -> None:
            try:
                self.finish(end=receive_rounds(member, receiver, job, self))
            except BaseException as e:  # noqa: BLE001 - handed to the generation loop, which raises it
                self.finish(error=e)

        thread = threading.Thread(target=receive, name="receive", daemon=True)
        thread.start()
        return thread


def receive_rounds(member: Member, receiver: VersionReceiver, job: Job, engine: Handover) -> End:
    """Take every round the controller announces until the job ends; returns its end. Raises
    VerificationError, StartAgain, or what the transfer raised."""
    rank, me = receiver.rank, who(INFERENCE, receiver.rank)
    transfer = job.transfer
    timeout = transfer.timeout
    counters = rank_counters(rank)  # its pod's /metrics
    late = member.joins_late(timeout)
    try:
        first = member.welcome() if late else Round(0)
    except FellBehind as e:
        raise StartAgain(f"{e}; ending this process so that it starts again and rejoins") from None
    if late:
        log(me, f"taken {'back' if member.attempt > 1 else 'in'} at {first.name}")
    for version in itertools.count(first.version):  # until the controller ends the job
        again = first.again if version == first.version else 0
        try:
            rnd = member.round(version, again)
        except JobEnded as e:
            return End(e.state, str(e))
        except FellBehind as e:
            raise StartAgain(f"{e}; ending this process so that it starts again and rejoins") from None
        if rank not in rnd.receivers:
            raise StartAgain(f"the controller counted this rank away at {rnd.name} (it was silent or cut "
                             "off); ending this process so that it starts again and rejoins")
        try:
            got = receiver.receive(version, engine.staging(), timeout, engine.base(rnd.bases.get(rank)))
        except ChecksumMismatch:  # bytes changed on the way: the job fails, naming it here
            raise
        except TransferError as e:  # frozen or cut off mid-version, the trainers hung up on it meanwhile
            try:
                if job.trainer.resumes:  # or a sender stopped, and the trainers resume
                    member.verdict(rnd, VERDICT_WAIT)
            except Dropped as dropped:
                log(me, f"{dropped}; {rnd.name} is left half received here; the model stays on the version it serves")
                continue
            if member.counted_away(rnd):
                raise StartAgain(f"{rnd.name} failed here ({e}): the controller counted this rank away meanwhile; "
                                 "ending this process so that it starts again and rejoins") from None
            raise
        counters.received(got.bytes)
        if got.refused:
            log(me, f"could not apply {len(got.refused)} patch(es) of {rnd.name}, first {got.refused[0]}; "
                    "the trainers sent those buckets whole")
        pause_point(INFERENCE, rank, "verifying", version)
        received = time.monotonic()
        if transfer.verify_digest:
            try:
                reference = member.awaited(version, Keys.ref_of(version, rank),
                                           f"the reference digest of version {version}", timeout).decode()
            except FellBehind as e:
                raise StartAgain(f"{e}; ending this process so that it starts again and rejoins") from None
            except Dropped as dropped:
                log(me, f"{dropped}; {rnd.name} is left unverified here; the model stays on the version it serves")
                continue
            if got.digest != reference:
                member.verification_failed()
                counters.checksum_failed()
                sent = (reference or "nothing for this rank")[:16]
                raise VerificationError(f"version {version} failed verification: digest {got.digest[:16]} received, "
                                        f"the trainers sent {sent}; the model stays on the version it runs")
        verified = time.monotonic() - received
        try:
            loaded = engine.offer(version, got)
        except LoadFailed as e:
            if job.inference.on_load_failure == FAIL_JOB:
                raise
            log(me, f"{e}; spec.inference.onLoadFailure {ROLL_BACK}: the job goes on, and the next version comes "
                    "to this rank whole")
            member.say_applied(version, Applied(got.digest, got.seconds, verify_seconds=round(verified, 6),
                                                load_failed=str(e), holds=e.holds))
            continue
        counters.serving(version)
        # seconds: receiving; verify_seconds: waiting for the reference digest and comparing;
        # load_seconds: the engine's load (the controller's round record shows the three)
        member.say_applied(version, Applied(got.digest, got.seconds, got.patched, len(got.refused),
                                            got.refused[0] if got.refused else None, round(verified, 6),
                                            None if loaded is None else round(loaded, 6)))
    raise AssertionError("unreachable")

