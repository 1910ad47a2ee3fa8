"""Which versions a job's vLLM server may serve its clients: only the fleet's current version, or
one at most spec.inference.maxVersionLag behind it. A server that starts, restarts or joins late
holds vLLM's start-up weights (dummy weights, or the checkpoint it was started on), and one whose
load failed part-way holds half of two versions: each would answer as well as any other, so the
guard (guard.py) answers its generation routes itself until it holds a version the fleet accepts.

What the server holds, the guard sees for itself: the job's controller labels every version it
loaded (vLLM's weight version, set by the signed /finish_weight_update or /update_weight_version)
before it resumes the server, so the label is in place before a request runs on the new weights;
a signed /update_weights that fails leaves the server holding no whole version. What the fleet
serves, the controller tells every server (ROUTE, signed), after every version it delivered and
every RENEW seconds, and the word lasts LEASE seconds: a server that stops hearing it (frozen,
cut off, its controller gone) stops serving. LEASE is shorter than the least time in which the
fleet can move on without a server (a round waits for a silent server's ranks to be gone, at least
two silent limits: 16 s), so a server frozen while a version went out never answers from the old
weights when it wakes. When the job ends the controller's last word lasts for ever: the servers
serve the job's final version.

A client that needs a version at least N sends `X-Weightsync-Min-Version: N`: a server behind it
answers 409 with the version it holds, never older tokens. Every refusal carries Retry-After and
`X-Weightsync-Version` (the version held, or "none"). /inference/v1/generate (vLLM's own field,
weight_versions) names the version of every token a server answers with: one version per request
under spec.inference.vllm.inflight finish, and where a request ran across a load under keep, the
version before for its first tokens and the new one for the rest (control.py, inflight.py).

GET ROUTE answers anyone with the server's admission (200 admitted, 503 not): the pod's readiness
follows it, and so can a load balancer's for a server the user started. Standard library only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

ROUTE = "/weightsync/admission"
MIN_VERSION_HEADER = "x-weightsync-min-version"
VERSION_HEADER = "x-weightsync-version"
RENEW = 1.5  # seconds between the controller's words to every server
LEASE = 6.0  # seconds a word lasts: less than the fleet needs to move on without a silent server
RETRY_AFTER = 1  # seconds a refused client waits before it asks again

# the routes that generate (the rest of the clients' routes, health, models, tokenization and
# metrics, answer whatever the server holds)
GENERATION_ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages",
    "/v1/systemone", "/inference/v1/generate", "/generative_scoring", "/invocations",
})
LABEL_ROUTES = {"/finish_weight_update": "weight_version", "/update_weight_version": "new_version"}
LOAD_ROUTE = "/update_weights"


@dataclass
class Admission:
    """One API process's view: the version it holds, and the fleet's as the controller last said."""

    held: int | None = None  # the version loaded and labelled last; None: none of the job's, or half of one
    why_none: str = "it holds no version of the job yet (it started, restarted or joined late)"
    current: int | None = None  # the fleet's version, as the controller said it
    lag: int = 0  # spec.inference.maxVersionLag
    until: float | None = 0.0  # time.monotonic() past which the controller's word no longer holds; None: ever

    def labelled(self, version: int, now: float) -> None:
        """The controller labelled the version the server loaded: it holds it, and it is the fleet's."""
        self.held = version
        if self.current is None or version > self.current:
            self.current = version
        self.until = None if self.until is None else max(self.until, now + LEASE)

    def load_failed(self) -> None:
        self.held = None
        self.why_none = "its last load failed part-way, so it holds no whole version until the next one loads"

    def told(self, current: int, lag: int, lease: float | None, now: float) -> None:
        """The controller's word: the fleet serves `current`, for `lease` seconds (None: for ever)."""
        self.current, self.lag = current, lag
        self.until = None if lease is None else now + lease

    def refusal(self, now: float, min_version: int | None = None) -> tuple[int, str] | None:
        """(status, why) where a generation request must not be served; None where it may."""
        if self.held is None:
            return 503, f"this server is out of its job's fleet: {self.why_none}"
        if self.current is None:
            return 503, f"this server holds version {self.held}, and the job's controller has not said which version " \
                        "the fleet serves"
        if self.until is not None and now > self.until:
            return 503, f"this server holds version {self.held}, and has not heard from the job's controller for " \
                        f"{now - self.until + LEASE:.0f}s (at most {LEASE:.0f}s): the fleet may have moved on"
        if self.current - self.held > self.lag:
            return 503, f"this server holds version {self.held}, {self.current - self.held} behind the fleet's " \
                        f"{self.current} (spec.inference.maxVersionLag {self.lag}); it catches up at the next version"
        if min_version is not None and self.held < min_version:
            return 409, f"this server holds version {self.held}, older than the {min_version} the request's " \
                        f"{MIN_VERSION_HEADER} asks for"
        return None

    def to_json(self, now: float) -> dict:
        refused = self.refusal(now)
        return {"admitted": refused is None, "held": self.held, "current": self.current, "lag": self.lag,
                **({"why": refused[1]} if refused else {})}


def told_by(query: bytes) -> tuple[int, int, float | None]:
    """(current, lag, lease) from the controller's word `?current=C&lag=L&lease=S` (lease 0: for ever);
    ValueError, saying what is wrong, otherwise."""
    given = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
    try:
        current, lag, lease = int(given["current"]), int(given.get("lag", 0)), float(given.get("lease", LEASE))
    except (KeyError, ValueError):
        raise ValueError(f"{ROUTE} takes ?current=<version>&lag=<versions>&lease=<seconds>, not "
                         f"?{query.decode('latin-1')}") from None
    if current < 0 or lag < 0 or lease < 0:
        raise ValueError(f"{ROUTE}: current, lag and lease are never negative")
    return current, lag, (lease or None)


def word(current: int, lag: int, lease: float | None = LEASE) -> str:
    """The target of the controller's word to a server (what told_by reads)."""
    return f"{ROUTE}?current={current}&lag={lag}&lease={0 if lease is None else lease}"


def label_of(route: str, body: bytes) -> int | None:
    """The version a signed label request sets (None: not a label, or not a number of the job's)."""
    field = LABEL_ROUTES.get(route)
    if field is None:
        return None
    try:
        value = json.loads(body or b"{}").get(field)
    except (ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, str) and value.isdigit() else None


def min_version(headers) -> int | None:
    """The lowest version the request accepts (its X-Weightsync-Min-Version), None where it names
    none; ValueError where it is not a version number."""
    for name, value in headers:
        if name.lower() == MIN_VERSION_HEADER.encode():
            text = value.decode("latin-1").strip()
            if not text.isdigit():
                raise ValueError(f"{MIN_VERSION_HEADER}: {text!r} is not a version number (0, 1, 2, ...)")
            return int(text)
    return None


def now() -> float:
    return time.monotonic()
