"""The rendezvous protocol through the controller's torch.distributed TCPStore.

Keys (role is "trainer" or "inference", rank the process's rank within its role):
  nonce/<role>/<rank>      controller: a fresh random challenge for that rank
  join/<role>/<rank>       rank: a counter; above 1 means the rank restarted after joining
  endpoint/<role>/<rank>   rank: where it can be reached (inference: the transport's endpoint)
  meta/<role>/<rank>       rank: its FlatLayout as json
  info/<role>/<rank>       rank: json {transport, why, device, pod}
  proof/<role>/<rank>      rank: HMAC(token, nonce, role, rank, endpoint, meta, info); the
                           controller accepts what a rank published only with a valid proof
  plan, plan/mac           controller: the plan and every rank's endpoint, HMAC'd with the token
  ready/<v>/<rank>         trainer: ready to send version v
  go/<v>                   controller: send version v (after every inference rank applied v-1)
  sent/<v>/<rank>          trainer: its bucket checksums, bytes, seconds, step and loss
  ref/<v>                  controller: the digest of version v computed from all trainers' sums
  applied/<v>/<rank>       inference: received, verified and switched to version v
  done/<v>                 controller: the version's record
  failed/<role>/<rank>     any rank: why it gave up (and the "failures" counter goes up)
  beat/<role>/<rank>       any rank: a counter bumped every HEARTBEAT seconds
  end                      controller: the job is over {"state", "message"}
  bye/<role>/<rank>        rank: saw the end; the controller may go
A store client serves one thread at a time (a blocking call holds it), so every thread that talks
to the store opens its own client.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import secrets
import threading
import time
from typing import Callable, Iterable, Iterator, Mapping

from .contract import INFERENCE, TRAINER, Layout

HEARTBEAT = 1.0  # seconds between heartbeats
STORE_TIMEOUT = 60.0  # seconds a single store call may block
POLL_MAX = 0.02  # seconds between checks of a key not yet set (first checks are quicker)
CHECK_EVERY = 0.25  # seconds between checks for the job's end while waiting


class JobEnded(RuntimeError):
    """The controller ended the job while this rank was waiting (the message says why)."""

    def __init__(self, state: str, message: str):
        self.state = state
        super().__init__(f"the job ended ({state}): {message}")


class Restarted(RuntimeError):
    """This rank already joined the job once: its process restarted."""


class ProofError(RuntimeError):
    """A rank or the controller could not prove it holds the job's token."""


def versions(spec: Mapping) -> Iterator[tuple[int, int]]:
    """(version, training step) of every weight version: 0 before training, then every
    transfer.everySteps steps and at the end. training.steps 0 trains without end."""
    steps, every = spec["training"]["steps"], spec["transfer"]["everySteps"]
    version, step = 0, 0
    while True:
        yield version, step
        if steps and step >= steps:
            return
        version, step = version + 1, step + every if not steps else min(step + every, steps)


def mac(token: bytes, *parts: str | bytes) -> str:
    h = hmac.new(token, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def host_store(port: int):
    """The controller's store, on every interface."""
    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", port, None, True, timeout=datetime.timedelta(seconds=STORE_TIMEOUT),
                         wait_for_workers=False)


def connect_store(host: str, port: int, timeout: float):
    """A client of the controller's store; retries until `timeout` while the controller starts."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:
        try:
            return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=min(STORE_TIMEOUT, timeout)))
        except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
            if time.monotonic() > deadline:
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

    def wait(self, keys: Iterable[str], what: str, timeout: float | None = None,
             check: Callable[[], None] | None = None, poll_max: float = POLL_MAX) -> None:
        """Poll until every key is set. `check` runs every CHECK_EVERY seconds and may raise;
        past `timeout` seconds a TimeoutError names `what`."""
        keys = list(keys)
        start = last_check = time.monotonic()
        pause = 0.0005
        while not self.store.check(keys):
            now = time.monotonic()
            if check and now - last_check >= CHECK_EVERY:
                check()
                last_check = now
            if timeout is not None and now - start > timeout:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimeoutError(f"waited {timeout:.0f}s for {what} ({', '.join(missing[:4])} not set)")
            time.sleep(pause)
            pause = min(pause * 1.5, poll_max)


def ranks_of(layout: Layout) -> list[tuple[str, int]]:
    return [(TRAINER, r) for r in range(layout.world_size(TRAINER))] + \
           [(INFERENCE, r) for r in range(layout.world_size(INFERENCE))]


def who(role: str, rank: int) -> str:
    return f"{role} rank {rank}"


class Member(Channel):
    """One trainer or inference rank's side of the rendezvous."""

    def __init__(self, host: str, port: int, token: bytes, role: str, rank: int, timeout: float):
        super().__init__(connect_store(host, port, timeout))
        self.address = (host, port, timeout)
        self.token, self.role, self.rank = token, role, rank
        self._beat: threading.Event | None = None

    @property
    def name(self) -> str:
        return who(self.role, self.rank)

    def client(self) -> Channel:
        """Another client of the same store, for another thread."""
        return Channel(connect_store(*self.address))

    def check_end(self) -> None:
        if self.has("end"):
            end = self.get_json("end")
            raise JobEnded(end["state"], end["message"])

    def wait_for(self, keys: Iterable[str] | str, what: str, timeout: float | None = None, poll_max: float = POLL_MAX) -> None:
        self.wait([keys] if isinstance(keys, str) else keys, what, timeout, self.check_end, poll_max)

    def wait_for_end(self) -> dict:
        """Wait for the controller's end of the job: {"state", "message"}."""
        self.wait(["end"], "the end of the job")
        return self.get_json("end")

    def join(self, endpoint: str, meta: str, info: str, timeout: float) -> None:
        """Publish endpoint, layout and info, proving the job token over the controller's nonce."""
        key = f"{self.role}/{self.rank}"
        if self.store.add(f"join/{key}", 1) > 1:
            raise Restarted(f"{self.name} restarted after it had joined the job; a job does not survive a rank restart")
        self.wait_for(f"nonce/{key}", "the controller's challenge", timeout)
        nonce = self.get(f"nonce/{key}")
        self.set(f"endpoint/{key}", endpoint)
        self.set(f"meta/{key}", meta)
        self.set(f"info/{key}", info)
        self.set(f"proof/{key}", mac(self.token, b"rank", nonce, self.role, str(self.rank), endpoint, meta, info))

    def plan(self, timeout: float):
        """The plan and {inference rank: endpoint}, checked to come from a holder of the token."""
        from .plan import Plan

        self.wait_for("plan/mac", "the transfer plan", timeout)
        text = self.get("plan")
        if not hmac.compare_digest(mac(self.token, b"plan", text), self.get("plan/mac").decode()):
            raise ProofError("the published plan is not signed with this job's token (a store shared by two jobs, or a wrong token file)")
        obj = json.loads(text)
        return Plan.from_json(obj["plan"]), {int(r): e for r, e in obj["endpoints"].items()}

    def fail(self, message: str) -> None:
        """Tell the controller why this rank gives up."""
        self.set(f"failed/{self.role}/{self.rank}", message)
        self.store.add("failures", 1)

    def bye(self) -> None:
        self.set(f"bye/{self.role}/{self.rank}", "1")

    def start_heartbeat(self) -> None:
        stop = self._beat = threading.Event()
        channel = self.client()
        key = f"beat/{self.role}/{self.rank}"

        def beat():
            while not stop.wait(HEARTBEAT):
                try:
                    channel.store.add(key, 1)
                except Exception:  # the controller is gone; the main thread finds out on its own
                    return

        channel.store.add(key, 1)
        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        if self._beat:
            self._beat.set()


class RankFailed(RuntimeError):
    """A rank failed or went silent; the message names it."""


class Host(Channel):
    """The controller's side: hosts the store, admits ranks, watches them."""

    def __init__(self, port: int, token: bytes, layout: Layout, silent_limit: float):
        super().__init__(host_store(port))
        self.token, self.layout, self.silent_limit = token, layout, silent_limit
        self.ranks = ranks_of(layout)
        self.failures_seen = 0
        self.beats: dict[tuple[str, int], tuple[int, float]] = {}
        self.last_beat_check = 0.0
        for role, rank in self.ranks:
            self.set(f"nonce/{role}/{rank}", secrets.token_hex(16))

    def admit(self, timeout: float) -> dict[tuple[str, int], tuple[str, str, dict]]:
        """Wait for every rank's proof; return {(role, rank): (endpoint, meta json, info)}."""
        admitted: dict[tuple[str, int], tuple[str, str, dict]] = {}
        deadline = time.monotonic() + timeout
        pause = 0.001
        while len(admitted) < len(self.ranks):
            self.check_ranks()
            for role, rank in self.ranks:
                key = f"{role}/{rank}"
                if (role, rank) in admitted or not self.has(f"proof/{key}"):
                    continue
                endpoint, meta, info = (self.get(f"{k}/{key}").decode() for k in ("endpoint", "meta", "info"))
                expect = mac(self.token, b"rank", self.get(f"nonce/{key}"), role, str(rank), endpoint, meta, info)
                if not hmac.compare_digest(expect, self.get(f"proof/{key}").decode()):
                    raise ProofError(f"{who(role, rank)} failed the job token proof (its token file differs from the job's Secret)")
                admitted[(role, rank)] = (endpoint, meta, json.loads(info))
            if time.monotonic() > deadline:
                missing = [who(r, k) for r, k in self.ranks if (r, k) not in admitted]
                raise TimeoutError(f"{len(missing)} ranks did not join within {timeout:.0f}s: {', '.join(missing[:6])}")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)
        return admitted

    def publish_plan(self, plan_json: str, endpoints: Mapping[int, str]) -> None:
        text = json.dumps({"plan": plan_json, "endpoints": {str(r): e for r, e in endpoints.items()}})
        self.set("plan", text)
        self.set("plan/mac", mac(self.token, b"plan", text))

    def check_ranks(self) -> None:
        """Raise RankFailed for a rank that reported a failure or whose heartbeat stopped."""
        failures = self.store.add("failures", 0)
        if failures > self.failures_seen:
            self.failures_seen = failures
            for role, rank in self.ranks:
                if self.has(f"failed/{role}/{rank}"):
                    raise RankFailed(f"{who(role, rank)} failed: {self.get(f'failed/{role}/{rank}').decode()}")
        now = time.monotonic()
        if now - self.last_beat_check < HEARTBEAT:
            return
        self.last_beat_check = now
        for role, rank in self.ranks:
            key = f"beat/{role}/{rank}"
            if not self.has(key):
                continue
            count = self.store.add(key, 0)
            seen = self.beats.get((role, rank))
            if seen is None or seen[0] != count:
                self.beats[(role, rank)] = (count, now)
            elif now - seen[1] > self.silent_limit:
                raise RankFailed(f"{who(role, rank)} is silent: no heartbeat for {now - seen[1]:.0f}s "
                                 "(its process died or lost the network)")

    def wait_ranks(self, keys: Iterable[str], what: str, timeout: float | None = None, poll_max: float = POLL_MAX) -> None:
        self.wait(keys, what, timeout, self.check_ranks, poll_max)

    def end(self, state: str, message: str) -> None:
        self.set("end", {"state": state, "message": message})

    def wait_byes(self, timeout: float) -> list[str]:
        """Wait (a bounded time) for every rank to see the end; returns those that did not."""
        keys = [f"bye/{r}/{k}" for r, k in self.ranks]
        try:
            self.wait(keys, "every rank to see the end", timeout)
            return []
        except TimeoutError:
            return [who(r, k) for r, k in self.ranks if not self.has(f"bye/{r}/{k}")]
