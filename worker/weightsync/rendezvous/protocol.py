"""The rendezvous protocol through the controller's store (store/: only the job's processes,
proving the job's token, can read or write it): a rank's side of it (the keys are named in
keys.py, the messages under them typed in messages.py).

Every key is named by Keys (keys.py). A rank joins with an attempt number (1, then one more each time
its process starts again): the controller issues a fresh challenge per attempt, the rank proves
the job token over it and what it publishes, and only then is it admitted. Each sending of a
version is a Round that the controller announces with the go: which inference ranks receive it
and which set of their endpoints (epoch) to use, so that an inference rank whose pod restarted
is taken back at the next version under its new endpoint (roster.py is the controller's side).
A store client serves one thread at a time (a blocking call holds it), so every thread that talks
to the store opens its own client.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from weightsync.job import INFERENCE, TRAINER, Job, Layout, logline, reasons
from weightsync.job.errors import JobFailed, TimedOut
from weightsync.job.token import mac, same
from weightsync.rendezvous.keys import Keys
from weightsync.rendezvous.messages import (
    End,
    Peer,
    PublishedPlan,
    RankFailure,
    RankInfo,
    Ready,
    ResumePoint,
    Round,
    cut_from_json,
    peers_from_json,
)
from weightsync.rendezvous.plan_shares import own_plan
from weightsync.rendezvous.store.server import StoreServer
from weightsync.rendezvous.store.table import Held, Limits, StoreError, StoreRefused, StoreTimeout
from weightsync.rendezvous.store.wire import UNSET

HEARTBEAT = 1.0  # seconds between heartbeats
STORE_TIMEOUT = 60.0  # seconds a single store call may block
CONNECTIONS_PER_RANK = 8  # store clients a rank may hold at once (main, heartbeat, DDP, transport, restarts)
CHECK_EVERY = 0.25  # seconds between checks for the job's end while waiting
STOPPED_CHECK_EVERY = 1.0  # the same, for a wait that the job's end (its stops) ends at once
CUT_POLL = 0.25  # seconds between a sending trainer's looks for receivers counted away
SAY_EVERY = 5.0  # seconds between two lines of a joining rank that still waits for the controller
GONE_WAIT = 1.0  # seconds to read a key a wait just saw set, before taking it for deleted meanwhile


class JobEnded(RuntimeError):
    """The controller ended the job while this rank was waiting (the message says why)."""

    def __init__(self, state: str, message: str):
        self.state = state
        super().__init__(f"the job ended ({state}): {message}")


class FellBehind(RuntimeError):
    """An inference rank waits for the go of a version the controller sent without it (it was
    frozen or cut off meanwhile, and counted away): it must start again and rejoin."""


class Dropped(RuntimeError):
    """The controller dropped the round this inference rank receives: a trainer rank stopped while
    it was on its way and the trainers resume from their checkpoint. Its bytes are half sent, never
    verified, and the rank goes on to the next version on the weights it serves."""


def dropped_on_its_way(version: int, why: bytes) -> Dropped:
    """What a receiver of `version` raises once the controller dropped it (Keys.dropped says why)."""
    return Dropped(f"version {version} was dropped on its way: {why.decode()}")


class Restarted(RuntimeError):
    """A trainer rank's process started again after it had joined: the job cannot go on."""


class Resuming(RuntimeError):
    """The job's trainers resume from their checkpoint (a trainer rank's process started again): this
    process, of an earlier start, ends so that it starts again and resumes with the others."""


class ProofError(JobFailed, RuntimeError):
    """A rank or the controller could not prove it holds the job's token."""

    reason = reasons.TOKEN_PROOF_FAILED


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


def host_store(address: str, port: int, token: bytes, job: str, ranks: int):
    """The controller's store, on the pod's own address, for the job's ranks and no one else."""
    return StoreServer(address, port, token, job, Limits(connections=CONNECTIONS_PER_RANK * ranks + 16), STORE_TIMEOUT)


def connect_store(host: str, port: int, token: bytes, job: str, timeout: float, call_timeout: float | None = None):
    """A client of the controller's store; retries until `timeout` while the controller starts.
    Each of its calls may block `call_timeout` seconds (default: the lesser of `timeout` and
    STORE_TIMEOUT). StoreRefused if this process's token (or job) is not the store's."""
    from weightsync.rendezvous.store.client import StoreClient  # torch

    calls = min(STORE_TIMEOUT, timeout) if call_timeout is None else call_timeout
    try:
        return StoreClient(host, port, token, job, timeout=calls, connect_timeout=timeout)
    except StoreRefused:
        raise
    except StoreError as e:
        raise ConnectionError(f"cannot reach the controller's store at {host}:{port} within {timeout:.0f}s: {e}") from None


class Channel:
    """Waiting on keys of one store client, with a callback that may raise while waiting."""

    def __init__(self, store):
        self.store = store

    def set(self, key: str, value: str | bytes | dict | list) -> None:
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def get_json(self, key: str):
        return json.loads(self.store.get(key))

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def peek(self, keys: Iterable[str]) -> list[bytes | None]:
        """The keys' values now (None where not set), in one request: a look at several keys that
        a waiting rank makes every CHECK_EVERY costs the store one request, not one per key."""
        return [None if v[:1] == UNSET else v[1:] for v in self.store.peek(list(keys))]

    def end(self) -> End | None:
        """The controller's end of the job, None while it runs."""
        return End.from_json(self.store.get(Keys.END)) if self.has(Keys.END) else None

    def wait_for_end(self, timeout: float | None = None, check: Callable[[], None] | None = None,
                     what: str = "the end of the job") -> End:
        """Wait for the controller's end of the job (TimeoutError past `timeout`; `check` as for wait)."""
        self.wait([Keys.END], what, timeout, check)
        return End.from_json(self.get(Keys.END))

    def cut_off(self, rnd: Round) -> list[int]:
        """The receivers of `rnd` the controller counted away while it was on its way (Keys.cut)."""
        key = Keys.cut(rnd.version, rnd.again)
        return cut_from_json(self.store.get(key)) if self.has(key) else []

    def starts(self, role: str, rank: int) -> int:
        """How many times (role, rank)'s process started (Keys.join; 0: not yet)."""
        return self.store.add(Keys.join(role, rank), 0)

    def resumes(self) -> int:
        """How many times the trainers began to resume from their checkpoint (Keys.RESUMING)."""
        return self.store.add(Keys.RESUMING, 0)

    def verification_failed(self) -> None:
        """Count a version that failed verification (Keys.VERIFY_FAILURES)."""
        self.store.add(Keys.VERIFY_FAILURES, 1)

    def verification_failures(self) -> int:
        return self.store.add(Keys.VERIFY_FAILURES, 0)

    def close(self) -> None:
        """Close this client's connection to the store."""
        self.store.close()

    def held(self) -> Held:
        """What the store holds and has served so far (all of it in the store's own process, the
        controller's; elsewhere the keys alone)."""
        return Held(self.store.num_keys(), getattr(self.store, "bytes_held", None), getattr(self.store, "requests", None))

    def rank_failed(self, role: str, rank: int, failure: RankFailure | BaseException | str) -> None:
        """Tell the controller why (role, rank) gave up (RankFailure.made), then bump the counter it watches."""
        self.set(Keys.failed(role, rank), RankFailure.made(failure).to_json())
        self.store.add(Keys.FAILURES, 1)

    def wait(self, keys: Iterable[str], what: str, timeout: float | None = None,
             check: Callable[[], None] | None = None, say: Callable[[str], None] | None = None,
             stops: Iterable[str] = ()) -> None:
        """Wait until every key is set: the store answers as soon as they are (nothing polls).
        `check` runs every CHECK_EVERY seconds and may raise; with `stops` (keys on which `check`
        raises: the job's end), it runs as soon as one is set and otherwise every STOPPED_CHECK_EVERY
        seconds, so that a thousand waiting ranks do not ask the store four times a second each;
        `say`, where given, is told every SAY_EVERY seconds that this still waits for `what`; past
        `timeout` seconds a TimeoutError names `what`."""
        keys, stops = list(keys), list(stops)
        began = told = time.monotonic()
        deadline = None if timeout is None else began + timeout
        while True:
            every = STOPPED_CHECK_EVERY if stops else CHECK_EVERY
            step = every if deadline is None else min(every, max(deadline - time.monotonic(), 0.0))
            stopped = False
            try:
                if not stops:
                    self.store.wait(keys, datetime.timedelta(seconds=step))
                    return
                if self.store.wait_or(keys, stops, datetime.timedelta(seconds=step)):
                    return
                stopped = True
            except TimeoutError:  # not yet (a store that stopped answering fails the next call)
                pass
            if check:
                check()
            if stopped:  # a stop on which `check` did not raise: looked at every CHECK_EVERY from now on
                stops = []
            if say is not None and time.monotonic() - told >= SAY_EVERY:
                told = time.monotonic()
                say(f"still waiting for {what} ({told - began:.0f}s" +
                    (f", {max(deadline - told, 0.0):.0f}s left)" if deadline is not None else ")"))
            if deadline is not None and time.monotonic() >= deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimedOut(f"waited {timeout:.0f}s for {what} ({', '.join(missing[:4])} not set)")


def ranks_of(layout: Layout) -> list[tuple[str, int]]:
    return [(TRAINER, r) for r in range(layout.world_size(TRAINER))] + \
           [(INFERENCE, r) for r in range(layout.world_size(INFERENCE))]


def who(role: str, rank: int) -> str:
    return f"{role} rank {rank}"


# The proofs below are hex HMACs (job/token.py) of their parts, each preceded by its length.
LENGTHS = "<Q"


def rank_proof(token: bytes, nonce: bytes, role: str, rank: int, endpoint: str, meta: str, info: str) -> str:
    """A rank's proof of what it published for an attempt, over the controller's nonce for it."""
    return mac(token, b"rank", nonce, role, str(rank), endpoint, meta, info, lengths=LENGTHS).hex()


def plan_mac(token: bytes, text: str | bytes) -> str:
    """The controller's signature of the plan it published."""
    return mac(token, b"plan", text, lengths=LENGTHS).hex()


def job_mac(token: bytes, identity: str, text: str | bytes) -> str:
    """The controller's signature of the job it published for external ranks, bound to the job's
    identity (namespace/name)."""
    return mac(token, b"job", identity, text, lengths=LENGTHS).hex()


def peers_mac(token: bytes, epoch: int, text: str | bytes) -> str:
    """The controller's signature of the inference ranks' endpoints as of `epoch`."""
    return mac(token, b"peers", str(epoch), text, lengths=LENGTHS).hex()


def update_proof(token: bytes, job: str, version: int) -> str:
    """What the controller sends with its request that a vLLM server load `version`: a load
    proves the job's token even where a server's control routes were open to its clients."""
    return mac(token, b"vllm-update", job, str(version), lengths=LENGTHS).hex()


def control_key(token: bytes, job: str) -> str:
    """The bearer key of a vLLM server's control routes (vllm_backend/guard.py): the controller
    and the pod's own process send it, a server of the job compares it; a key, not the token,
    so that what crosses the wire opens those routes and nothing else."""
    return mac(token, b"vllm-control", job, lengths=LENGTHS).hex()


class Member(Channel):
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

    def check_end(self) -> None:
        end = self.end()
        if end is not None:
            raise JobEnded(end.state, end.message)
        if self.role == TRAINER:
            self.check_resuming()

    def wait_for(self, keys: Iterable[str] | str, what: str, timeout: float | None = None, say: bool = False) -> None:
        """Wait for `keys` until the job's end; `say`: a line every SAY_EVERY seconds says what
        this rank still waits for (while it joins: a rank that waits silently looks hung)."""
        self.wait([keys] if isinstance(keys, str) else keys, what, timeout, self.check_end, self.say if say else None,
                  stops=[Keys.END])

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
        self.set(Keys.ready(version, self.rank), Ready(step).to_json())

    def closing(self, last: int) -> None:
        """A trainer rank: it publishes no more versions, the last it published being `last`
        (-1: none); the controller counts the trainer ranks that closed."""
        self.set(Keys.closed(self.rank), str(last))
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
            self.set(Keys.published(what, self.role, self.rank, attempt), value)
        self.set(Keys.published("proof", self.role, self.rank, attempt),
                 rank_proof(self.token, nonce, self.role, self.rank, endpoint, meta, info))
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

    def round(self, version: int, again: int = 0, timeout: float | None = None) -> Round:
        """Wait for the controller's go for that round (TimeoutError past `timeout` seconds). An
        inference rank that waits for a version whose go the controller has already said, and
        deleted (it forgets a round's keys two versions on), was left behind: FellBehind, instead
        of a wait for a key that will never come back."""
        key = Keys.go(version, again)
        self.wait([key], f"the controller's go for version {version}", timeout,
                  self.behind(version, key) if not again else self.check_end,
                  stops=self.stops(version) if not again else [Keys.END])
        return Round.from_json(self.seen(key, version))

    def seen(self, key: str, version: int) -> bytes:
        """The value of `key` of round `version`, which a wait just saw set. Where it is gone
        meanwhile (an inference rank frozen between the two, the controller forgot the round),
        FellBehind at once, not a wait for a key that will never come back."""
        try:
            return self.store.get(key, wait=GONE_WAIT)
        except StoreTimeout:
            self.behind(version, key)()
            raise

    def behind(self, version: int, key: str) -> Callable[[], None]:
        """A check for an inference rank's wait for `key` of round `version`: the job's end, and
        FellBehind once the controller has gone on to a later version and the key is gone (its
        round's keys are deleted two versions on), so that a rank that was frozen or cut off
        meanwhile does not wait for a key that will never come back; and FellBehind once the
        controller counted this start away, whatever it waits for (after the final version no later
        one comes to tell it, and the controller waits for it to rejoin)."""
        def check() -> None:
            if self.role != INFERENCE:
                self.check_end()
                return
            end, dropped, why, latest, there = self.peek([Keys.END, Keys.dropped(version),
                                                          Keys.away(self.rank, self.attempt), Keys.LATEST, key])
            if end is not None:
                ended = End.from_json(end)
                raise JobEnded(ended.state, ended.message)
            if dropped is not None:
                raise dropped_on_its_way(version, dropped)
            if why is not None:
                raise FellBehind(f"the controller counted this rank away while it waited for {key} of version "
                                 f"{version} ({why.decode()})")
            if latest is not None and int(latest) > version and there is None:
                raise FellBehind(f"waited for {key} of version {version}, but the controller went on to "
                                 f"version {int(latest)} without this rank: it was frozen or cut off")
        return check

    def stops(self, version: int) -> list[str]:
        """The keys on which behind(version, ...)'s check raises at once (Channel.wait's stops): the
        job's end, and for an inference rank `version` dropped and this start counted away."""
        if self.role != INFERENCE:
            return [Keys.END]
        return [Keys.END, Keys.dropped(version), Keys.away(self.rank, self.attempt)]

    def check_dropped(self, version: int) -> None:
        """Dropped where the controller dropped `version` (a trainer rank stopped mid-way)."""
        if self.has(Keys.dropped(version)):
            raise dropped_on_its_way(version, self.get(Keys.dropped(version)))

    def verdict(self, rnd: Round, timeout: float) -> None:
        """An inference rank whose receive of `rnd` failed in a job whose trainers resume: wait up
        to `timeout` seconds for the controller to say what became of the round, as it may have
        lost a sender that stopped. Dropped where it dropped the round; returns where it went on
        without this rank, or said nothing in time (the caller's error stands)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_end()
            self.check_dropped(rnd.version)
            if self.counted_away(rnd):
                return
            time.sleep(CHECK_EVERY)

    def away(self) -> str | None:
        """Why the controller counted this start of an inference rank away; None where it did not."""
        key = Keys.away(self.rank, self.attempt)
        return self.get(key).decode() if self.has(key) else None

    def replica_epoch(self, start: int) -> int:
        """How many times the controller counted the tensor-parallel replica whose first inference
        rank is `start` away: its ranks form their process group under that number."""
        return int(self.get(Keys.replica(start))) if self.has(Keys.replica(start)) else 0

    def latest(self) -> int | None:
        """The latest version the controller announced, None before the first."""
        return int(self.get(Keys.LATEST)) if self.has(Keys.LATEST) else None

    def counted_away(self, rnd: Round) -> bool:
        """Whether the controller went on without this inference rank in round `rnd`: it cut it off
        (the trainers stopped sending to it), or it is at a later version already, which it only
        is once every receiver of the round applied it or was counted away."""
        if self.rank in self.cut_off(rnd):
            return True
        latest = self.latest()
        return latest is not None and latest > rnd.version

    def joins_late(self, timeout: float) -> bool:
        """Whether this inference rank joins the running job, taken in at a later round than the
        first (its welcome says which): its process started again, or its pod was scaled up to
        after the ranks joined (the plan's endpoints, epoch 0, do not name it)."""
        return self.attempt > 1 or self.rank not in self.peers(0, timeout)

    def welcome(self) -> Round:
        """A rejoined inference rank: the round it receives first (the controller says it at the
        next version, or at once when the trainers are done)."""
        key = Keys.welcome(self.rank, self.attempt)

        def check() -> None:  # counted away again meanwhile (frozen, or its replica went): never taken back
            self.check_end()
            if (why := self.away()) is not None:
                raise FellBehind(f"the controller counted this rank away while it waited to be taken back ({why})")
        self.wait([key], "the controller to take this rank back at the next version", None, check)
        return Round.from_json(self.get(key))

    def fail(self, failure: RankFailure | BaseException | str) -> None:
        """Tell the controller why this rank gives up."""
        self.rank_failed(self.role, self.rank, failure)

    def bye(self) -> bool:
        """Tell the controller this rank saw the job's end; False where the controller had already
        gone (it waits a bounded time for every goodbye, then goes: the job's end stands)."""
        try:
            self.set(Keys.bye(self.role, self.rank), "1")
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
