"""The messages that the job's processes leave for each other in the rendezvous store, typed.

Each is a frozen dataclass with its JSON written and read in one place (to_json, from_json), so a
reader knows the shape of what a rank publishes and of what the controller reads back, and a field
added is added on both sides at once. JSON object keys are strings: the ranks and offsets that key
these messages are ints again once read. The store keys they live under are in keys.Keys.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Protocol

from weightsync.job import reasons
from weightsync.transfer.sums import Sums


class Record(Protocol):
    """What the store holds under a key: a message of this module, written as its to_json says."""

    def to_json(self) -> str: ...


@dataclass(frozen=True)
class Mark:
    """A word whose key says it all (a goodbye, the controller's word that a server does not load a
    version, a count's key touched): "1"."""

    def to_json(self) -> str:
        return "1"


@dataclass(frozen=True)
class Number:
    """One number: the last version a trainer rank published, the latest version, a replica's departures."""

    value: int

    def to_json(self) -> str:
        return str(self.value)

    @classmethod
    def from_json(cls, text: str | bytes) -> Number:
        return cls(int(text))


@dataclass(frozen=True)
class Text:
    """Text kept byte for byte, as signed or proven: what a rank published (its endpoint, layout and
    info) and its proof, a nonce, the job and the plan as published and their MACs; or a line that
    says why (a rank counted away, a version dropped)."""

    value: str

    def to_json(self) -> str:
        return self.value


@dataclass(frozen=True)
class Done:
    """The controller's record of a round once done (Keys.done): status.transfer's fields."""

    fields: Mapping[str, Any]

    def to_json(self) -> str:
        return json.dumps(dict(self.fields))


@dataclass(frozen=True)
class Round:
    """One sending of a version (the controller's go, Keys.go): to which inference ranks, at which
    of their endpoints, and (delta versions) to which of them as a delta against the version they
    hold."""

    version: int
    again: int = 0  # 0: the version's first sending; n: the n-th repeat of the final version
    receivers: tuple[int, ...] = ()
    epoch: int = 0
    bases: Mapping[int, int] = field(default_factory=dict)  # {receiver: its base}; the others get it whole

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "again": self.again, "receivers": list(self.receivers),
                           "epoch": self.epoch, "bases": {str(r): b for r, b in self.bases.items()}})

    @classmethod
    def from_json(cls, text: str | bytes) -> Round:
        obj = json.loads(text)
        return cls(obj["version"], obj["again"], tuple(obj["receivers"]), obj["epoch"],
                   {int(r): b for r, b in obj.get("bases", {}).items()})

    @property
    def name(self) -> str:
        return f"version {self.version}" + (f" (sent again, {self.again})" if self.again else "")


@dataclass(frozen=True)
class Peer:
    """An inference rank as the trainers dial it: a new attempt is a new process, whose old
    connections are dead even where its endpoint is the same (a pod keeps its address)."""

    endpoint: str
    attempt: int


def peers_to_json(peers: Mapping[int, Peer]) -> str:
    """The inference ranks' endpoints as of an epoch (Keys.peers), in rank order."""
    return json.dumps({str(r): {"endpoint": p.endpoint, "attempt": p.attempt} for r, p in sorted(peers.items())})


def peers_from_json(text: str | bytes) -> dict[int, Peer]:
    return {int(r): Peer(p["endpoint"], p["attempt"]) for r, p in json.loads(text).items()}


def cut_to_json(receivers: Iterable[int]) -> str:
    """The receivers of a round the controller counted away while it was on its way (Keys.cut),
    in rank order."""
    return json.dumps(sorted(receivers))


@dataclass(frozen=True)
class Cut:
    """The receivers of a round the controller counted away while it was on its way (Keys.cut)."""

    receivers: Iterable[int]

    def to_json(self) -> str:
        return cut_to_json(self.receivers)


def cut_from_json(text: str | bytes) -> list[int]:
    return [int(r) for r in json.loads(text)]


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the controller about itself when it joins, besides its endpoint and its
    layout (Keys.published "info"; the rank's proof covers it)."""

    transport: str  # the transport it chose
    why: str = ""  # why that one
    device: str = ""  # where its weights live ("cpu", "cuda:0")
    pod: str = ""  # its pod's name
    holds: Any = None  # a trainer holding shards: its Holdings, as Holdings.to_json() makes them
    needs: Any = None  # an inference rank holding slices: what it needs, as needs_to_json() makes it
    engine: str | None = None  # "vllm" for a worker of a vLLM server
    server: str | None = None  # that server's control URL, where the controller asks it to load a version

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankInfo:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Admission:
    """What a rank published for one attempt, read back once it proved the job token over it."""

    endpoint: str  # where the trainers dial it (an inference rank), or its pod's address (a trainer)
    meta: str  # its FlatLayout, as FlatLayout.to_json() makes it
    info: RankInfo


@dataclass(frozen=True)
class SentReport:
    """A trainer rank's report of one round it sent (Keys.sent): what the controller checks the
    inference ranks' digests against, and what it reports of the round."""

    bytes: int  # its share of the version
    seconds: float
    checksums: Mapping[int, int] = field(default_factory=dict)  # {offset: xxh3_64} of its buckets (Sums once read)
    # over slices: {receiver: {offset: xxh3_64}} of each receiver's own buckets (Sums once read)
    receiver_checksums: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    step: int | None = None  # the training step of the version (None: a training script that did not say)
    loss: float | None = None
    lost: Mapping[int, str] = field(default_factory=dict)  # {receiver: why} the receivers it lost on the way
    wire_bytes: int = 0  # what it put on the wire for all receivers (less than bytes x receivers with deltas)
    changed: int = 0  # elements that changed since the base, in the buckets sent as patches
    compared: int = 0  # elements compared there

    def to_json(self) -> str:
        return json.dumps({"bytes": self.bytes, "seconds": self.seconds, "step": self.step, "loss": self.loss,
                           "checksums": Sums.of(self.checksums).to_text(),
                           "receiver_checksums": {str(r): Sums.of(by).to_text()
                                                  for r, by in self.receiver_checksums.items()},
                           "lost": _keyed(self.lost), "wire_bytes": self.wire_bytes, "changed": self.changed,
                           "compared": self.compared})

    @classmethod
    def from_json(cls, text: str | bytes) -> SentReport:
        obj = json.loads(text)
        return cls(obj["bytes"], obj["seconds"], Sums.from_text(obj["checksums"]),
                   {int(r): Sums.from_text(by) for r, by in obj["receiver_checksums"].items()}, obj["step"], obj["loss"],
                   _unkeyed(obj["lost"]), obj["wire_bytes"], obj["changed"], obj["compared"])


def _keyed(by_int: Mapping[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in by_int.items()}


def _unkeyed(by_str: Mapping[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in by_str.items()}


@dataclass(frozen=True)
class End:
    """The controller's end of the job (Keys.END), which every rank waits for or checks: its state
    (job.states), the reason of a failure, and the line that says why."""

    state: str
    message: str = ""
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps({"state": self.state, "reason": self.reason, "message": self.message})

    @classmethod
    def from_json(cls, text: str | bytes) -> End:
        obj = json.loads(text)
        return cls(obj["state"], obj.get("message", ""), obj.get("reason", ""))


@dataclass(frozen=True)
class Ready:
    """A trainer rank is ready to send a version (Keys.ready), at this training step (None: its
    script did not say): the controller checks that every trainer rank says the same."""

    step: int | None = None

    def to_json(self) -> str:
        return json.dumps({"step": self.step})

    @classmethod
    def from_json(cls, text: str | bytes) -> Ready:
        """A value that is no such object (a bare "1") says no step, as a ready without one."""
        try:
            obj = json.loads(text)
        except ValueError:
            return cls()
        return cls(obj.get("step")) if isinstance(obj, dict) else cls()


@dataclass(frozen=True)
class ResumePoint:
    """Where the trainers resume (Keys.RESUME), published once the controller took every trainer
    rank back: the next version, the last delivered and its step (None before the first), and the
    start of each trainer rank it took back (a rank finds its own start there)."""

    resumes: int  # the resumes begun so far (Keys.RESUMING)
    version: int  # the next version
    delivered: int | None = None
    step: int | None = None
    attempts: Mapping[int, int] = field(default_factory=dict)  # {trainer rank: its start}

    def to_json(self) -> str:
        return json.dumps({"resumes": self.resumes, "version": self.version, "delivered": self.delivered,
                           "step": self.step, "attempts": _keyed(self.attempts)})

    @classmethod
    def from_json(cls, text: str | bytes) -> ResumePoint:
        obj = json.loads(text)
        return cls(obj["resumes"], obj["version"], obj["delivered"], obj["step"], _unkeyed(obj["attempts"]))


@dataclass(frozen=True)
class Applied:
    """An inference rank received, verified and switched to a version (Keys.applied), or failed
    to load it part-way and says which version it holds instead: its digest, which the controller
    checks, and where its seconds went, for the round's record."""

    digest: str
    seconds: float | None = None  # receiving
    patched: int = 0  # buckets applied as patches on its base
    refused: int = 0  # patches it could not apply (the trainers sent those buckets whole)
    why_refused: str | None = None  # the first of them
    verify_seconds: float | None = None  # waiting for the reference digest and comparing
    load_seconds: float | None = None  # the engine's load (None: an engine that loads nothing)
    # the load failed part-way (spec.inference.onLoadFailure rollBack): why, and the version the
    # engine went back to, loaded whole and verified (None: none; it serves none until the next)
    load_failed: str | None = None
    holds: int | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None or k not in ("load_failed", "holds")})

    @classmethod
    def from_json(cls, text: str | bytes) -> Applied:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Staged:
    """A vLLM worker received and verified a version and waits for its server to load it
    (Keys.staged): its digest, whether its weight-update session is open and kept open
    (vllm_backend.control.Session), and with loadAhead how long its shadow load took."""

    digest: str
    session_open: bool = False
    keep_session: bool = False
    prepare_seconds: float | None = None  # loadAhead only

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, text: str | bytes) -> Staged:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Reference:
    """What a round's receivers check their digest against (Keys.ref): the version's digest, or
    over slices each receiver's own digest (a JSON object), as transfer.receive.reference_digests
    makes them."""

    digest: str | None = None  # the whole version's
    receivers: Mapping[int, str] = field(default_factory=dict)  # over slices: {receiver: its digest}

    @classmethod
    def made(cls, digests: str | Mapping[int, str]) -> Reference:
        return cls(digests) if isinstance(digests, str) else cls(receivers=dict(digests))

    def of(self, receiver: int) -> str | None:
        """The digest `receiver` must have (None: over slices, not in the round)."""
        return self.digest if self.digest is not None else self.receivers.get(receiver)

    def to_json(self) -> str:
        return self.digest if self.digest is not None else json.dumps(_keyed(self.receivers), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Reference:
        text = text.decode() if isinstance(text, bytes) else text
        return cls(receivers=_unkeyed(json.loads(text))) if text.startswith("{") else cls(text)


@dataclass(frozen=True)
class PublishedPlan:
    """The transfer plan as the controller publishes it once every rank joined (Keys.PLAN, signed
    under Keys.PLAN_MAC): the plan's own JSON (plan.sliced_plan.plan_from_json reads it)."""

    plan: str

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan})

    @classmethod
    def from_json(cls, text: str | bytes) -> PublishedPlan:
        return cls(json.loads(text)["plan"])


@dataclass(frozen=True)
class RankFailure:
    """Why a rank gave up, as it reports it to the controller (Keys.failed): the reason the job's
    status gives (job/reasons.py) and the message that names the particulars. The reason is the
    error's own where it carries one (a JobFailed's, a transport error's: ChecksumMismatch,
    TransportError), OutOfMemory and TimedOut for the standard library's and torch's kinds, else
    RankFailed."""

    reason: str
    message: str

    @classmethod
    def of(cls, error: BaseException) -> RankFailure:
        own = getattr(error, "reason", None)  # (urllib's errors have a reason of another kind)
        if isinstance(own, str) and own in reasons.DESCRIPTIONS:
            reason = own
        elif isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":  # torch's
            reason = reasons.OUT_OF_MEMORY
        elif isinstance(error, TimeoutError):
            reason = reasons.TIMED_OUT
        else:
            reason = reasons.RANK_FAILED
        return cls(reason, f"{type(error).__name__}: {error}")

    @classmethod
    def made(cls, what: RankFailure | BaseException | str) -> RankFailure:
        """The record of `what`: an error classified (of), or a message of the rank's own words (RankFailed)."""
        if isinstance(what, RankFailure):
            return what
        return cls.of(what) if isinstance(what, BaseException) else cls(reasons.RANK_FAILED, what)

    def to_json(self) -> str:
        return json.dumps({"reason": self.reason, "message": self.message})

    @classmethod
    def from_json(cls, text: str | bytes) -> RankFailure:
        obj = json.loads(text)
        return cls(obj["reason"], obj["message"])
