"""Driving a vLLM server's weight update over its HTTP control routes, with a deadline on every call.

vLLM loads weights only between two scheduler steps, through its engine's control routes (served
when VLLM_SERVER_DEV_MODE=1). One update, for weightsync, is: start (opens vLLM's update session;
weightsync's engine changes nothing there, so the server serves on) at once with pause, mode=wait
(no new request starts, those in flight finish on the weights they started on) and the KV and
prefix caches cleared (cached blocks were computed with the old weights), update (the backend loads the
version it already received and verified), finish with weightsync's version number as vLLM's
weight version (vLLM reports it with every generation), resume. A request therefore runs on exactly
one version, and the server serves nothing only between the pause and the resume: the load and
two short calls. Not mode=keep: it freezes the requests in flight and resumes them on the new
weights, so a request would run on two versions; and vLLM has no route that loads and labels a
version in one call (update_weights needs an open session, which only finish closes and labels).

Standard library only: the controller, which has no vLLM, drives the servers with it.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

UP_POLL = 0.5  # seconds between looks at a starting server's /health
RESUME_TIMEOUT = 10.0  # seconds a resume may take at least, even past the update's deadline


class ControlError(RuntimeError):
    """A control call failed or ran out of time; the message names the server and the route."""


class Unreachable(ControlError):
    """The server gave no answer: it could not be reached, dropped the connection, or ran out of
    time. Its process may be gone (killed, preempted) or frozen, which its ranks' heartbeats tell;
    a server that answered an error is a ControlError, never this."""


@dataclass(frozen=True)
class Server:
    url: str  # http://host:port

    def call(self, route: str, body: dict | None, timeout: float, method: str = "POST") -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise ControlError(f"{self.url}{route} answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # TimeoutError is an OSError
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise Unreachable(f"{self.url}{route} did not answer within {timeout:.0f}s: {reason}") from None
            raise Unreachable(f"{self.url}{route} could not be reached: {reason or type(e).__name__}") from None
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

    def init_transfer(self, timeout: float) -> None:
        self.call("/init_weight_transfer_engine", {"init_info": {}}, timeout)

    def weight_version(self, timeout: float = 10.0) -> str | None:
        return self.call("/weight_info", None, timeout, method="GET").get("weight_version")

    def update(self, version: int, proof: str, timeout: float) -> UpdateTimes:
        """Load `version` (already received and verified by the backend) between two steps; returns
        how long each call took and how long the server served nothing (pause to resume). The
        server is resumed also when a step in between fails."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ControlError(f"{self.url} did not finish the update to version {version} within {timeout:.0f}s")
            return remaining

        def timed(route: str, body: dict | None, limit: float) -> float:
            began = time.monotonic()
            self.call(route, body, limit)
            return time.monotonic() - began

        # The update session opens while the server pauses, on a thread of its own: weightsync's
        # start_weight_update changes nothing (the reload is set up in update_weights, once the
        # update was checked), so the server serves on while it answers; and vLLM's pause answers
        # 20 ms after its engine paused, time in which the engine takes the start. The update
        # waits for both.
        with ThreadPoolExecutor(1) as opener:
            opening = opener.submit(timed, "/start_weight_update", None, left())
            # clear_cache: a prompt cached before the load would otherwise reuse the old
            # version's KV blocks after it, under the new version's label
            pause = timed("/pause?mode=wait&clear_cache=true", None, left())
            paused = time.monotonic()
            try:
                start = opening.result()
                update = timed("/update_weights", {"update_info": {"version": version, "proof": proof}}, left())
                finish = timed("/finish_weight_update", {"weight_version": str(version)}, left())
            except ControlError as e:  # resumed all the same; what failed first is what the error says
                try:
                    timed("/resume", None, RESUME_TIMEOUT)
                except ControlError as also:
                    raise type(e)(f"{e}; then {also}") from None
                raise
        resume = timed("/resume", None, max(deadline - time.monotonic(), RESUME_TIMEOUT))
        return UpdateTimes(pause=pause, start=start, update=update, finish=finish, resume=resume,
                           stall=time.monotonic() - paused)


@dataclass(frozen=True)
class UpdateTimes:
    """One server's update as the controller saw it: seconds each control call took to answer,
    and the stall, from the pause's answer to the resume's (the server served nothing)."""

    pause: float
    start: float
    update: float
    finish: float
    resume: float
    stall: float

    @staticmethod
    def slowest(times: list[UpdateTimes]) -> UpdateTimes:
        """Each call's longest time, and the longest stall, over the servers (zeros for none)."""
        return UpdateTimes(**{f.name: max((getattr(t, f.name) for t in times), default=0.0) for f in fields(UpdateTimes)})

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
