"""Driving a vLLM server's weight update over its HTTP control routes, with a deadline on every call.

vLLM loads weights only between two scheduler steps, through its engine's control routes (served
when VLLM_SERVER_DEV_MODE=1, and by a job's server only to the job's control key: guard.py),
inside a weight-update session that start_weight_update opens and finish_weight_update closes.
weightsync's engine changes nothing at either end (it loads in place, the case vLLM's API leaves
those two calls empty for), so a server serves on with a session open,
and its workers keep it open from one version to the next: a version then takes one call of its
workers, the load, as vLLM's own disk reload does. Each of their calls costs more than its answer
on a busy machine: a vLLM worker busy-polls its message queue for a second after every call it
answers, so calls that follow one another land while the cores spin.

One update, for weightsync, is: pause; and at once, where no session is open yet (a server's first
version, or its first after a failed load, which closes it), start; update (the backend loads the
version it already received and verified); the version's label, weightsync's version number as
vLLM's weight version (vLLM reports it with every generation), set by update_weight_version, which
only the engine core answers; resume. Where a worker needs the session closed after every load
(where vLLM invalidates a LoRA server's state), the label comes with finish_weight_update instead,
in the pause as well. The server serves nothing between the pause and the resume: the load and two
short calls. What the pause does to the requests in flight is spec.inference.vllm.inflight's:
- finish: mode=wait. No new request starts, those in flight finish on the weights they started on,
  and the KV and prefix caches are cleared once they have (clear_cache): a request runs on exactly
  one version, and the longest one in flight holds the load back. The clearing costs nothing a
  kept cache would have served: once the requests in flight finished, no request of the old version
  is left to reuse its blocks.
- keep: mode=keep, clear_cache=false. The requests in flight are frozen where they are, KV blocks
  and all, and resume on the new version: none is aborted, none holds the load back, and each
  names the version of every token it generated (vLLM's weight_versions, from the label the engine
  core holds at each step). Clearing the cache would preempt them and prefill each again on the new
  weights (vLLM resets running requests to clear it); instead no new request reuses a block of
  the old version, since the server's guard salts every request's cache key with the version
  (inflight.py). An update that fails once the load began aborts the requests it froze (mode=abort,
  which clears the cache) before the resume: they would resume on weights no version names.

Standard library only: the controller, which has no vLLM, drives the servers with it.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from weightsync.rendezvous.messages import Staged
from weightsync.vllm_backend.admission import ROUTE
from weightsync.vllm_backend.guard import sign

UP_POLL = 0.5  # seconds between looks at a starting server's /health
RESUME_TIMEOUT = 10.0  # seconds a resume may take at least, even past the update's deadline
UNGUARDED_PROBE = "/get_world_size"  # a control route that changes nothing (Server.open_to_clients)
# the pauses of an update (spec.inference.vllm.inflight finish and keep), and the one that aborts
# the requests a failed update froze
FINISH_PAUSE = "/pause?mode=wait&clear_cache=true"
KEEP_PAUSE = "/pause?mode=keep&clear_cache=false"
ABORT_PAUSE = "/pause?mode=abort&clear_cache=true"


class ControlError(RuntimeError):
    """A control call failed or ran out of time; the message names the server and the route,
    `status` the HTTP status the server answered (None where it answered none), `body` the start
    of its answer."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body


class Unreachable(ControlError):
    """The server gave no answer: it could not be reached, dropped the connection, or ran out of
    time. Its process may be gone (killed, preempted) or frozen, which its ranks' heartbeats tell;
    a server that answered an error is a ControlError, never this. `refused`: nothing listens on
    its port (the connection was refused), as opposed to a server that is slow or silent."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class Session:
    """vLLM's weight-update session on a server, as its workers said when they staged a version:
    `open`, every worker has one open (the version before left it so), and start is not called;
    `keep`, every worker keeps it open after this load, so the label is set without closing it."""

    open: bool = False
    keep: bool = False

    @classmethod
    def of(cls, staged: list[Staged]) -> Session:
        """A server's session from its workers' staged records."""
        return cls(open=bool(staged) and all(s.session_open for s in staged),
                   keep=bool(staged) and all(s.keep_session for s in staged))


class Steps(ABC):
    """One server's update, step by step (update): each step one call of the server's, answered
    within `limit` seconds, or ControlError naming the server and the call (Unreachable where it
    gave no answer). Over its HTTP control routes (Server), or through whatever else drives the
    server from the controller's process (integrations/vllm_actor.py: a vLLM Ray actor's methods)."""

    name: str  # how errors name the server

    @abstractmethod
    def pause(self, limit: float, keep: bool = False) -> None:
        """No request starts; those in flight finish and the KV and prefix caches are cleared, or,
        with `keep`, they are frozen where they are, the caches kept (spec.inference.vllm.inflight)."""

    @abstractmethod
    def abort(self, limit: float) -> None:
        """The requests frozen in flight are aborted, the caches cleared (a kept update that failed)."""

    @abstractmethod
    def start(self, limit: float) -> None:
        """vLLM's start_weight_update: a session opens."""

    @abstractmethod
    def load(self, version: int, proof: str, limit: float) -> None:
        """vLLM's update_weights: the workers load `version`, which they hold verified."""

    @abstractmethod
    def finish(self, label: str, limit: float) -> None:
        """vLLM's finish_weight_update: the session closes, and the weight version is `label`."""

    @abstractmethod
    def label(self, label: str, limit: float) -> None:
        """vLLM's update_weight_version, the session left open."""

    @abstractmethod
    def resume(self, limit: float) -> None:
        """Requests run again."""

    def update(self, version: int, proof: str, timeout: float, session: Session = Session(),
               keep: bool = False) -> UpdateTimes:
        """Load `version` (already received and verified by the backend) between two steps; returns
        how long each call took and how long the server served nothing (pause to resume). The
        server is resumed also when a step in between fails. `session`: what its workers said of
        vLLM's update session as they staged the version (the default opens one and closes it);
        `keep`: the requests in flight are frozen and resumed on the version (spec.inference.vllm.inflight)."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ControlError(f"{self.name} did not finish the update to version {version} within {timeout:.0f}s")
            return remaining

        def timed(step, *args) -> float:
            began = time.monotonic()
            step(*args)
            return time.monotonic() - began

        # A session opens while the server pauses, on a thread of its own: weightsync's
        # start_weight_update changes nothing, so the server serves on while it answers; and
        # vLLM's pause answers 20 ms after its engine paused, time in which the engine takes the
        # start (a job's guard answers a keep pause without them: inflight.pause_kept). The
        # update waits for both.
        start = finish = label = None
        loading = False  # the load was asked for: from here on the weights may be neither version
        with ThreadPoolExecutor(1) as opener:
            opening = None if session.open else opener.submit(timed, self.start, left())
            pause = timed(self.pause, left(), keep)
            paused = time.monotonic()
            try:
                if opening is not None:
                    start = opening.result()
                loading = True
                update = timed(self.load, version, proof, left())
                if session.keep:
                    label = timed(self.label, str(version), left())
                else:
                    finish = timed(self.finish, str(version), left())
            except ControlError as e:  # resumed all the same; what failed first is what the error says
                steps = ([self.abort] if keep and loading else []) + [self.resume]
                try:
                    for step in steps:
                        timed(step, RESUME_TIMEOUT)
                except ControlError as also:
                    raise type(e)(f"{e}; then {also}") from None
                if len(steps) > 1:
                    raise type(e)(f"{e}; the requests frozen in flight were aborted: they would have resumed on "
                                  f"weights no version names") from None
                raise
        resume = timed(self.resume, max(deadline - time.monotonic(), RESUME_TIMEOUT))
        return UpdateTimes(pause=pause, start=start, update=update, finish=finish, version=label, resume=resume,
                           stall=time.monotonic() - paused)


@dataclass(frozen=True)
class Server(Steps):
    url: str  # http://host:port
    # the job's control key (rendezvous/proofs.control_key), which signs every call (guard.sign):
    # a job's server answers its control routes to nothing else (guard.py)
    key: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.url

    def call(self, route: str, body: dict | None, timeout: float, method: str = "POST") -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.key is not None:
            headers["Authorization"] = "Bearer " + sign(self.key, method, urlsplit(self.url).path + route)
        request = urllib.request.Request(self.url + route, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ControlError(f"{self.url}{route} answered {e.code}: {detail}", e.code, detail) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # TimeoutError is an OSError
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise Unreachable(f"{self.url}{route} did not answer within {timeout:.0f}s: {reason}") from None
            raise Unreachable(f"{self.url}{route} could not be reached: {reason or type(e).__name__}",
                              refused=isinstance(reason, ConnectionRefusedError)) from None
        try:
            return json.loads(text) if text else {}
        except ValueError:
            return {"text": text}

    def up(self) -> bool:
        try:
            self.call("/health", None, 2.0, method="GET")
            return True
        except ControlError:
            return False

    def wait_up(self, timeout: float, alive=lambda: True) -> None:
        """Wait until the server answers /health; Unreachable past `timeout`, or at once when
        alive() says its process is gone."""
        deadline = time.monotonic() + timeout
        while not self.up():
            if not alive():
                raise Unreachable(f"the vLLM server for {self.url} exited before it served")
            if time.monotonic() > deadline:
                raise Unreachable(f"the vLLM server at {self.url} did not come up within {timeout:.0f}s")
            time.sleep(UP_POLL)

    def open_to_clients(self, timeout: float = 10.0) -> bool:
        """Whether the server lacks weightsync's middleware (guard.py), asked without the job's key
        of a control route that changes nothing (GET /get_world_size). Only the middleware's 401
        says it is there: it answers a keyless request for any route not a client's so, before
        vLLM routes it, while a server without it answers (200), or has no such route (404: a vLLM
        without that route, or without VLLM_SERVER_DEV_MODE). Unreachable where it does not answer."""
        try:
            Server(self.url).call(UNGUARDED_PROBE, None, timeout, method="GET")
        except Unreachable:
            raise
        except ControlError as e:
            return e.status != 401
        return True

    def admission(self, timeout: float = 2.0) -> tuple[bool, dict]:
        """Whether the server is admitted to its job's fleet, and what it said (admission.py);
        Unreachable where it does not answer."""
        try:
            return True, self.call(ROUTE, None, timeout, method="GET")
        except Unreachable:
            raise
        except ControlError as e:
            try:
                return False, (json.loads(e.body) if e.status == 503 else {})
            except ValueError:
                return False, {}

    def init_transfer(self, timeout: float) -> None:
        self.call("/init_weight_transfer_engine", {"init_info": {}}, timeout)

    def weight_version(self, timeout: float = 10.0) -> str | None:
        return self.call("/weight_info", None, timeout, method="GET").get("weight_version")

    # the update's steps (Steps), each one of the server's control routes
    def pause(self, limit: float, keep: bool = False) -> None:
        self.call(KEEP_PAUSE if keep else FINISH_PAUSE, None, limit)

    def abort(self, limit: float) -> None:
        self.call(ABORT_PAUSE, None, limit)

    def start(self, limit: float) -> None:
        self.call("/start_weight_update", None, limit)

    def load(self, version: int, proof: str, limit: float) -> None:
        self.call("/update_weights", {"update_info": {"version": version, "proof": proof}}, limit)

    def finish(self, label: str, limit: float) -> None:
        self.call("/finish_weight_update", {"weight_version": label}, limit)

    def label(self, label: str, limit: float) -> None:
        self.call("/update_weight_version", {"new_version": label}, limit)

    def resume(self, limit: float) -> None:
        self.call("/resume", None, limit)


@dataclass(frozen=True)
class UpdateTimes:
    """One server's update as the controller saw it: seconds each control call took to answer
    (None for a call this update did not make), and the stall, from the pause's answer to the
    resume's (the server served nothing)."""

    pause: float
    start: float | None
    update: float
    finish: float | None
    version: float | None  # update_weight_version
    resume: float
    stall: float

    @staticmethod
    def slowest(times: list[UpdateTimes]) -> UpdateTimes:
        """Each call's longest time over the servers that made it, and the longest stall (zeros
        for no server)."""
        def longest(name: str) -> float | None:
            made = [getattr(t, name) for t in times if getattr(t, name) is not None]
            return max(made) if made else (0.0 if name in MADE_BY_EVERY_UPDATE else None)
        return UpdateTimes(**{f.name: longest(f.name) for f in fields(UpdateTimes)})

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


MADE_BY_EVERY_UPDATE = ("pause", "update", "resume", "stall")
