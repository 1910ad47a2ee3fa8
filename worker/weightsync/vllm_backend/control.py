"""Driving a vLLM server's weight update over its HTTP control routes, with a deadline on every call.

vLLM loads weights only between two scheduler steps, through its engine's control routes (served
when VLLM_SERVER_DEV_MODE=1). One update, for weightsync, is: pause with mode=wait (no new request
starts, those in flight finish on the weights they started on) and the KV and prefix caches
cleared (cached blocks were computed with the old weights), start, update (the backend loads
the version it already received and verified), finish with weightsync's version number as vLLM's
weight version (vLLM reports it with every generation), resume. A request therefore runs on exactly
one version, and the server serves nothing only between the pause and the resume.

Standard library only: the controller, which has no vLLM, drives the servers with it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

UP_POLL = 0.5  # seconds between looks at a starting server's /health


class ControlError(RuntimeError):
    """A control call failed or ran out of time; the message names the server and the route."""


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
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ControlError(f"{self.url}{route} did not answer within {timeout:.0f}s: {getattr(e, 'reason', e)}") from None
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
        """Wait until the server answers /health; ControlError past `timeout`, or at once when
        alive() says its process is gone."""
        deadline = time.monotonic() + timeout
        while not self.up():
            if not alive():
                raise ControlError(f"the vLLM server for {self.url} exited before it served")
            if time.monotonic() > deadline:
                raise ControlError(f"the vLLM server at {self.url} did not come up within {timeout:.0f}s")
            time.sleep(UP_POLL)

    def init_transfer(self, timeout: float) -> None:
        self.call("/init_weight_transfer_engine", {"init_info": {}}, timeout)

    def weight_version(self, timeout: float = 10.0) -> str | None:
        return self.call("/weight_info", None, timeout, method="GET").get("weight_version")

    def update(self, version: int, proof: str, timeout: float) -> float:
        """Load `version` (already received and verified by the backend) between two steps; returns
        the seconds the server served nothing (pause to resume). The server is resumed also when
        a step in between fails."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ControlError(f"{self.url} did not finish the update to version {version} within {timeout:.0f}s")
            return remaining

        # clear_cache: a prompt cached before the load would otherwise reuse the old version's KV
        # blocks after it, under the new version's label
        self.call("/pause?mode=wait&clear_cache=true", None, left())
        paused = time.monotonic()
        try:
            self.call("/start_weight_update", None, left())
            self.call("/update_weights", {"update_info": {"version": version, "proof": proof}}, left())
            self.call("/finish_weight_update", {"weight_version": str(version)}, left())
        finally:
            self.call("/resume", None, max(left() if time.monotonic() < deadline else 0.0, 10.0))
        return time.monotonic() - paused
