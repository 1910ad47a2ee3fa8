"""A client of the controller's store (store/: only the job's processes, proving the job's token,
can read or write it), and waiting on its keys: what every rendezvous object, the controller's
Host (roster.py) and a rank's Member (protocol.py) alike, does with its store. Also the
controller's hosting of that store, and a client's connecting to it.

A store client serves one thread at a time (a blocking call holds it), so every thread that talks
to the store opens its own client.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterable

from weightsync.job import reasons
from weightsync.job.errors import JobFailed, TimedOut
from weightsync.job.token import same
from weightsync.rendezvous.keys import Keys
from weightsync.rendezvous.messages import Admission, End, Mark, RankFailure, RankInfo, Record, Round, cut_from_json
from weightsync.rendezvous.proofs import rank_proof
from weightsync.rendezvous.store.server import StoreServer
from weightsync.rendezvous.store.table import Held, Limits, StoreError, StoreRefused
from weightsync.rendezvous.store.wire import UNSET

STORE_TIMEOUT = 60.0  # seconds a single store call may block
CONNECTIONS_PER_RANK = 8  # store clients a rank may hold at once (main, heartbeat, DDP, transport, restarts)
CHECK_EVERY = 0.25  # seconds between checks for the job's end while waiting
STOPPED_CHECK_EVERY = 1.0  # the same, for a wait that the job's end (its stops) ends at once
SAY_EVERY = 5.0  # seconds between two lines of a joining rank that still waits for the controller


class JobEnded(RuntimeError):
    """The controller ended the job while this rank was waiting (the message says why)."""

    def __init__(self, state: str, message: str):
        self.state = state
        super().__init__(f"the job ended ({state}): {message}")


class ProofError(JobFailed, RuntimeError):
    """A rank or the controller could not prove it holds the job's token."""

    reason = reasons.TOKEN_PROOF_FAILED


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

    def set(self, key: str, record: Record) -> None:
        """`record` under `key`: a message (messages.py), never a bare value."""
        self.store.set(key, record.to_json())

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

    def published_by(self, token: bytes, role: str, rank: int, attempt: int) -> Admission:
        """What (role, rank) published for `attempt` (Member.join: its endpoint, layout and info),
        proven with the job's token over the controller's nonce for that attempt; ProofError where
        the proof fails. The one check of a rank's proof: the controller's as it admits a rank
        (Host.proven), a trainer's as it reads its receivers' servers (Member.info_of)."""
        endpoint, meta, info, proof = (self.get(Keys.published(k, role, rank, attempt)).decode()
                                       for k in ("endpoint", "meta", "info", "proof"))
        if not same(proof, rank_proof(token, self.get(Keys.nonce(role, rank, attempt)), role, rank, endpoint, meta, info)):
            raise ProofError(f"{role} rank {rank} failed the job token proof (its token file differs from the job's "
                             "Secret)")
        return Admission(endpoint, meta, RankInfo.from_json(info))

    def say_bye(self, role: str, rank: int) -> None:
        """(role, rank) saw the job's end (its own goodbye, or its pod's process's for it)."""
        self.set(Keys.bye(role, rank), Mark())

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
        self.set(Keys.failed(role, rank), RankFailure.made(failure))
        self.store.add(Keys.FAILURES, 1)

    def wait(self, keys: Iterable[str], what: str, timeout: float | None = None,
             check: Callable[..., None] | None = None, say: Callable[[str], None] | None = None,
             stops: Iterable[str] = (), looks: Iterable[str] | None = None) -> list[bytes]:
        """Wait until every key is set, and return their values: the store answers as soon as
        they are, with them (nothing polls, and nothing is read again after the wait). `check`
        runs every CHECK_EVERY seconds and may raise; with `stops` (keys on which `check` raises:
        the job's end), it runs as soon as one is set and otherwise every STOPPED_CHECK_EVERY
        seconds, so that a thousand waiting ranks do not ask the store four times a second each.
        With `looks`, the store answers each step with the values of the keys, the stops and the
        looks, and `check` is given them ({key: value, None where not set}) to look at instead of
        asking the store again. `say`, where given, is told every SAY_EVERY seconds that this
        still waits for `what`; past `timeout` seconds a TimeoutError names `what`."""
        keys, stops, looks = list(keys), list(stops), None if looks is None else list(looks)
        began = told = time.monotonic()
        deadline = None if timeout is None else began + timeout
        while True:
            every = STOPPED_CHECK_EVERY if stops else CHECK_EVERY
            step = every if deadline is None else min(every, max(deadline - time.monotonic(), 0.0))
            asked = keys + stops + (looks or [])
            values = [None if v[:1] == UNSET else v[1:] for v in self.store.wait_get(keys, stops, looks or [], step)]
            if all(v is not None for v in values[:len(keys)]):
                return values[:len(keys)]
            stopped = any(v is not None for v in values[len(keys):len(keys) + len(stops)])
            if check and looks is not None:
                check(dict(zip(asked, values)))
            elif check:
                check()
            if stopped:  # a stop on which `check` did not raise: looked at every CHECK_EVERY from now on
                stops = []
            if say is not None and time.monotonic() - told >= SAY_EVERY:
                told = time.monotonic()
                say(f"still waiting for {what} ({told - began:.0f}s" +
                    (f", {max(deadline - told, 0.0):.0f}s left)" if deadline is not None else ")"))
            if deadline is not None and time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values) if v is None]
                raise TimedOut(f"waited {timeout:.0f}s for {what} ({', '.join(missing[:4])} not set)")
