"""The rendezvous protocol through the controller's store (store/: only the job's processes,
proving the job's token, can read or write it): a rank's side of it (the keys are named in
keys.py, the messages under them typed in messages.py).

Every key is named by Keys (keys.py). A rank joins with an attempt number (1, then one more each time
its process starts again): the controller issues a fresh challenge per attempt, the rank proves
the job token over it and what it publishes, and only then is it admitted. Each sending of a
version is a Round that the controller announces with the go: which inference ranks receive it
and which set of their endpoints (epoch) to use, so that an inference rank whose pod restarted
is taken back at the next version under its new endpoint (roster.py is the controller's side).
The store's client and the waits on its keys are channel.py's, the proofs of the token
proofs.py's, and an inference rank's following of the rounds following.py's.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping

from weightsync.job import INFERENCE, TRAINER, Job, Layout, logline
from weightsync.job.errors import TimedOut
from weightsync.job.token import same
from weightsync.rendezvous.channel import CHECK_EVERY, Channel, JobEnded, ProofError, connect_store
from weightsync.rendezvous.following import Following
from weightsync.rendezvous.keys import Keys
from weightsync.rendezvous.messages import (
    Applied,
    End,
    Number,
    Peer,
    PublishedPlan,
    RankFailure,
    RankInfo,
    Ready,
    ResumePoint,
    Round,
    SentReport,
    Staged,
    Text,
    peers_from_json,
)
from weightsync.rendezvous.plan_shares import own_plan
from weightsync.rendezvous.proofs import peers_mac, plan_mac, rank_proof
from weightsync.rendezvous.proofs import update_proof as update_proof  # the vLLM engine imports it from here
from weightsync.rendezvous.store.table import StoreError, StoreRefused

HEARTBEAT = 1.0  # seconds between heartbeats
CUT_POLL = 0.25  # seconds between a sending trainer's looks for receivers counted away


class Restarted(RuntimeError):
    """A trainer rank's process started again after it had joined: the job cannot go on."""


class Resuming(RuntimeError):
    """The job's trainers resume from their checkpoint (a trainer rank's process started again): this
    process, of an earlier start, ends so that it starts again and resumes with the others."""


def versions(job: Job) -> Iterator[tuple[int, int]]:
    """(version, training step) of every weight version the built-in trainer publishes: 0 before
    training, then every transfer.every_steps steps and at the end. training.steps 0 trains
    without end."""
    steps, every = job.training.steps, job.transfer.every_steps
    version, step = 0, 0
    while True:
        yield version, step
        if steps and step >= steps:
            return
        version, step = version + 1, step + every if not steps else min(step + every, steps)


def ranks_of(layout: Layout) -> list[tuple[str, int]]:
    return [(TRAINER, r) for r in range(layout.world_size(TRAINER))] + \
           [(INFERENCE, r) for r in range(layout.world_size(INFERENCE))]


def who(role: str, rank: int) -> str:
    return f"{role} rank {rank}"


class Member(Following, Channel):
    """One trainer or inference rank's side of the rendezvous."""

    def __init__(self, host: str, port: int, token: bytes, role: str, rank: int, timeout: float, *, job: str):
        try:
            super().__init__(connect_store(host, port, token, job, timeout))
        except StoreRefused as e:
            raise ProofError(f"{who(role, rank)} failed the job token proof: {e}") from None
        self.address = (host, port, token, job, timeout)
        self.token, self.role, self.rank = token, role, rank
        self.resumes_seen: int | None = None  # a trainer's: the resumes begun when it joined (watch_resumes)
        self.attempt = 0  # set by join(): 1 for the rank's first process, then one more per restart
        self._beat: threading.Event | None = None
        self.beating: Channel | None = None  # the heartbeat thread's client of the store
        self._watcher: Channel | None = None

    @property
    def name(self) -> str:
        return who(self.role, self.rank)

    def client(self) -> Channel:
        """Another client of the same store, for another thread."""
        return Channel(connect_store(*self.address))

    def c10d_store(self, prefix: str | None = None):
        """Another client of the same store as a torch.distributed Store, its keys under `prefix`
        where given: for what takes a Store object (a process group, a transport's handshake)."""
        store = connect_store(*self.address)
        if prefix is None:
            return store
        import torch.distributed as dist

        return dist.PrefixStore(prefix, store)

    @contextmanager
    def cuts(self, rnd: Round, on_cut: Callable[[int], None], every: float = CUT_POLL) -> Iterator[None]:
        """While the body sends `rnd`: each receiver the controller counts away meanwhile
        (Keys.cut) is handed to on_cut once, from a thread with a store client of its own."""
        if self._watcher is None:
            self._watcher = self.client()
        watcher, stop, seen = self._watcher, threading.Event(), set()

        def watch() -> None:
            while not stop.wait(every):
                try:
                    cut = watcher.cut_off(rnd)
                except Exception:  # noqa: BLE001 - the controller is gone; the sending thread finds out on its own
                    return
                for r in cut:
                    if r in rnd.receivers and r not in seen:
                        seen.add(r)
                        on_cut(r)

        thread = threading.Thread(target=watch, name=f"cuts-{rnd.name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def check_end(self, seen: Mapping[str, bytes | None] | None = None) -> None:
        """JobEnded once the controller ended the job (Resuming for a trainer of an earlier start);
        where a wait just read Keys.END (`seen`, Channel.wait's looks), looked at there."""
        if seen is not None and Keys.END in seen:
            end = None if seen[Keys.END] is None else End.from_json(seen[Keys.END])
        else:
            end = self.end()
        if end is not None:
            raise JobEnded(end.state, end.message)
        if self.role == TRAINER:
            self.check_resuming()

    def wait_for(self, keys: Iterable[str] | str, what: str, timeout: float | None = None, say: bool = False) -> None:
        """Wait for `keys` until the job's end; `say`: a line every SAY_EVERY seconds says what
        this rank still waits for (while it joins: a rank that waits silently looks hung)."""
        self.wait([keys] if isinstance(keys, str) else keys, what, timeout, self.check_end, self.say if say else None,
                  stops=[Keys.END], looks=[])

    def say(self, message: str) -> None:
        logline.say(self.name, message)

    def arrive(self, resumes: bool = False) -> int:
        """Count this process's start (at once, before anything slow: the controller learns of
        a restart from it); returns the attempt. A trainer's process that started again raises
        Restarted (the controller ends the job), unless its trainers `resume` from their own
        checkpoint (a user's script): then it joins with that start (resumed())."""
        self.attempt = attempt = self.store.add(Keys.join(self.role, self.rank), 1)
        if attempt > 1 and self.role == TRAINER and not resumes:
            raise Restarted(f"{self.name} restarted after it had joined the job (start {attempt}); trainers do not "
                            "rejoin a running job: the built-in trainer keeps no checkpoint to resume from")
        return attempt

    def resumed(self, timeout: float) -> ResumePoint:
        """A trainer rank that started again: where the trainers resume, once the controller took
        every trainer rank back (Keys.RESUME)."""
        def taken() -> bool:
            return self.has(Keys.RESUME) and self.resume_point().attempts.get(self.rank) == self.attempt

        deadline = time.monotonic() + timeout
        while not taken():
            self.check_end()
            if time.monotonic() > deadline:
                raise TimedOut(f"waited {timeout:.0f}s for the controller to take every trainer rank back")
            try:  # RESUME is set once per resume, and this rank's start must be in it
                self.wait([Keys.RESUME], "where the trainers resume", CHECK_EVERY, self.check_end)
            except TimeoutError:
                pass
            time.sleep(0.05)
        return self.resume_point()

    def resume_point(self) -> ResumePoint:
        return ResumePoint.from_json(self.get(Keys.RESUME))

    def watch_resumes(self) -> None:
        """From now on, this trainer rank's waits end (Resuming) once the trainers begin to resume
        again: a process of an earlier start must end so that it starts again with the others."""
        self.resumes_seen = self.resumes()

    def check_resuming(self) -> None:
        if self.resumes_seen is not None and self.resumes() > self.resumes_seen:
            raise Resuming(f"{self.name}: the job's trainers resume from their checkpoint (a trainer rank started again); "
                           "this process ends so that it starts again and resumes with them")

    def ready(self, version: int, step: int | None) -> None:
        """A trainer rank: ready to send `version`, at training step `step`."""
        self.set(Keys.ready(version, self.rank), Ready(step))

    def ready_of(self, version: int, rank: int) -> Ready:
        """What trainer rank `rank` said when it was ready to send `version` (it was)."""
        return Ready.from_json(self.get(Keys.ready(version, rank)))

    def say_sent(self, rnd: Round, report: SentReport) -> None:
        """A trainer rank: what it sent in `rnd`."""
        self.set(Keys.sent(rnd.version, rnd.again, self.rank), report)

    def say_staged(self, version: int, staged: Staged) -> None:
        """An inference rank of a vLLM server: `version` is verified in its staging, to be loaded."""
        self.set(Keys.staged(version, self.rank, self.attempt), staged)

    def unloaded(self, version: int) -> bool:
        """Whether the controller told this rank its server does not load `version` (Keys.unloaded)."""
        return self.has(Keys.unloaded(version, self.rank, self.attempt))

    def say_applied(self, version: int, applied: Applied) -> None:
        """An inference rank: what became of `version` here (verified, loaded or not)."""
        self.set(Keys.applied(version, self.rank, self.attempt), applied)

    def done_record(self, version: int) -> dict:
        """The controller's record of `version`, once done (status.transfer's fields)."""
        return self.get_json(Keys.done(version))

    def plan_bytes(self, epoch: int = 0) -> int:
        """The bytes of the plan's header and of the inference ranks' endpoints of `epoch`, as published."""
        return len(self.get(Keys.PLAN)) + len(self.get(Keys.peers(epoch)))

    def info_of(self, role: str, rank: int, attempt: int) -> RankInfo:
        """What (role, rank) told about itself for `attempt`, proven with the job's token."""
        return self.published_by(self.token, role, rank, attempt).info

    def closing(self, last: int) -> None:
        """A trainer rank: it publishes no more versions, the last it published being `last`
        (-1: none); the controller counts the trainer ranks that closed."""
        self.set(Keys.closed(self.rank), Number(last))
        self.store.add(Keys.CLOSED, 1)

    def join(self, endpoint: str, meta: str, about: RankInfo, timeout: float) -> int:
        """Publish endpoint, layout and what the rank tells about itself, proving the job token over
        the controller's nonce for this attempt; returns the attempt."""
        attempt = self.attempt or self.arrive()
        info = about.to_json()
        self.wait_for(Keys.nonce(self.role, self.rank, attempt), f"the controller's challenge for start {attempt} "
                      "(it issues one as soon as it sees this start)", timeout, say=True)
        nonce = self.get(Keys.nonce(self.role, self.rank, attempt))
        for what, value in (("endpoint", endpoint), ("meta", meta), ("info", info)):
            self.set(Keys.published(what, self.role, self.rank, attempt), Text(value))
        self.set(Keys.published("proof", self.role, self.rank, attempt),
                 Text(rank_proof(self.token, nonce, self.role, self.rank, endpoint, meta, info)))
        return attempt

    def plan(self, timeout: float):
        """The plan and {inference rank: endpoint} as of the given epoch, checked to come from a
        holder of the token."""
        plan = own_plan(self, self.plan_text(timeout), timeout, ProofError)
        return plan, {r: p.endpoint for r, p in self.peers(0, timeout).items()}

    def plan_text(self, timeout: float) -> str:
        """The plan's JSON as the controller published it, checked to come from a holder of the token."""
        self.wait_for(Keys.PLAN_MAC, "the transfer plan (the controller publishes it once every rank joined)", timeout,
                      say=True)
        text = self.get(Keys.PLAN)
        if not same(self.get(Keys.PLAN_MAC).decode(), plan_mac(self.token, text)):
            raise ProofError("the published plan is not signed with this job's token (a store shared by two jobs, "
                             "or a wrong token file)")
        return PublishedPlan.from_json(text).plan

    def peers(self, epoch: int, timeout: float) -> dict[int, Peer]:
        """{inference rank: Peer} as of `epoch`, checked to come from a holder of the token."""
        key = Keys.peers(epoch)
        self.wait_for(key + "/mac", f"the inference ranks' endpoints (epoch {epoch})", timeout, say=True)
        text = self.get(key)
        if not same(self.get(key + "/mac").decode(), peers_mac(self.token, epoch, text)):
            raise ProofError(f"the endpoints of epoch {epoch} are not signed with this job's token")
        return peers_from_json(text)

    def fail(self, failure: RankFailure | BaseException | str) -> None:
        """Tell the controller why this rank gives up."""
        self.rank_failed(self.role, self.rank, failure)

    def bye(self) -> bool:
        """Tell the controller this rank saw the job's end; False where the controller had already
        gone (it waits a bounded time for every goodbye, then goes: the job's end stands)."""
        try:
            self.say_bye(self.role, self.rank)
        except StoreError:
            return False
        return True

    def start_heartbeat(self) -> None:
        stop = self._beat = threading.Event()
        channel = self.beating = self.client()  # the heartbeat's own client (another, where one call failed)
        key = Keys.beat(self.role, self.rank)

        def beat():
            failed = None
            while not stop.wait(HEARTBEAT):
                try:
                    self.beating = self.beating or self.client()
                    self.beating.store.add(key, 1)
                    failed = None
                except Exception as e:  # noqa: BLE001 - one call that failed (a busy store, a reset connection)
                    # must not silence the rank for good: a new client at the next beat; where the
                    # controller is gone, the main thread finds out on its own
                    if failed is None:
                        self.say(f"a heartbeat did not reach the controller ({e}); trying again every {HEARTBEAT:g}s")
                    failed, self.beating = e, None

        channel.store.add(key, 1)
        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        if self._beat:
            self._beat.set()
