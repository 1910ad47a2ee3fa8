"""How an external vLLM server's workers get their inference ranks: each claims one through the
controller's store, and the controller assigns it.

A pod of the job knows its rank from its ordinal; a server the user started knows only its own
URL (WEIGHTSYNC_VLLM_SERVER) and, for each of its workers, the worker's rank within the server. So
each worker posts a Claim (numbered by a counter in the store: claims never overwrite each other)
and waits for the controller's Answer: an inference rank, or one line saying why not. The
controller decides every claim alone, in order, so two servers starting at once cannot take the
same rank. A server is bound to one model replica of its size (its workers, the tensor-parallel
ranks of that replica, in worker order); the controller refuses:

- a server for another model: the names, shapes and dtype it loads (its layout) are not those of
  the trainers' model (once a trainer rank joined; before, the worker has checked its layout
  against spec.model itself, and the plan checks every rank's layout against the trainers');
- a server whose worker count is no free replica's tensor-parallel degree (spec.inference.
  tensorParallel, or tensorParallelSizes);
- the same server (URL) claiming a worker that is already there (joined, serving or waiting to);
- any server once every replica is held by a server that is there (the job is full).

A server whose worker is away (it stopped; the roster counted it away) can claim its rank again
under the same URL: it rejoins as a restarted pod does. Where every worker of a replica is away,
a server under another URL can take that replica over.

A claim only reserves a rank: the worker is then admitted exactly as the job's own pods are (its
attempt counted, the controller's nonce, its proof of the token over what it publishes;
protocol.py). Only the job's processes can post or answer, the store being the token's.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

from weightsync.job import INFERENCE, Layout
from weightsync.model.flat import FlatLayout, LayoutMismatch
from weightsync.rendezvous.channel import Channel
from weightsync.rendezvous.protocol import who

CLAIMS = "claims"  # counter: claims posted (claim/<n> is the n-th)
# seconds a granted rank counts as there before its worker is admitted (its attempt counted: from
# then on the roster says whether it is there), so that a second claim cannot slip in meanwhile
ARRIVAL = 60.0


def claim_key(number: int) -> str:
    """a vLLM worker: its Claim."""
    return f"claim/{number}"


def answer_key(number: int) -> str:
    """controller: its Answer to claim `number`."""
    return f"claim/{number}/answer"


class ClaimRefused(RuntimeError):
    """The controller refused the claim; the message, one line, says why and what to fix."""


@dataclass(frozen=True)
class Claim:
    """What a vLLM worker asks for: a rank for worker `worker` of the server at `server`."""

    server: str  # the server's URL as the controller reaches it
    worker: int  # the worker's rank within its server (vLLM's parallel_config.rank)
    workers: int  # the server's workers (vLLM's parallel_config.world_size)
    layout: str  # the FlatLayout of the model it serves (names, shapes, dtype), as FlatLayout.to_json() makes it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Claim:
        return cls(**json.loads(text))

    @property
    def name(self) -> str:
        return f"the vLLM server at {self.server}" + (f" (worker {self.worker})" if self.workers > 1 else "")


@dataclass(frozen=True)
class Answer:
    rank: int | None = None
    refused: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Answer:
        return cls(**json.loads(text))


def claim(channel: Channel, request: Claim, timeout: float, check: Callable[[], None] | None = None) -> int:
    """Post `request` and wait (at most `timeout` seconds; `check` runs meanwhile and may raise,
    e.g. at the job's end) for the controller's answer: the inference rank, or ClaimRefused."""
    number = channel.store.add(CLAIMS, 1)
    channel.set(claim_key(number), request)
    channel.wait([answer_key(number)], f"the controller to answer the claim of {request.name}", timeout, check)
    answer = Answer.from_json(channel.get(answer_key(number)))
    if answer.refused:
        raise ClaimRefused(answer.refused)
    return answer.rank


class Claims:
    """The controller's side: answers every claim posted so far (serve), in the order they come.
    `reference()` is the trainers' layout, None before one joined; `there(rank)` says whether the
    worker that holds an inference rank is there (not counted away)."""

    def __init__(self, layout: Layout, job: str, reference: Callable[[], FlatLayout | None],
                 say: Callable[[str], None]):
        self.layout, self.job, self.reference, self.say = layout, job, reference, say
        self.replicas: dict[str, int] = {}  # server URL -> the replica (inference pod ordinal - first) it holds
        self.holders: dict[int, str] = {}  # inference rank -> the URL of the server that claimed it
        self.granted: dict[int, float] = {}  # inference rank -> when it was last given
        self.seen = 0  # claims counted so far
        self.pending: set[int] = set()  # counted, not yet posted in full

    def serve(self, channel: Channel, there: Callable[[int], bool]) -> None:
        total = channel.store.add(CLAIMS, 0)
        self.pending.update(range(self.seen + 1, total + 1))
        self.seen = total
        for number in sorted(self.pending):
            if not channel.has(claim_key(number)):
                continue  # its worker counted it but has not posted it yet
            self.pending.discard(number)
            request = Claim.from_json(channel.get(claim_key(number)))
            answer = self.decide(request, there)
            channel.set(answer_key(number), answer)
            if answer.refused:
                self.say(f"refused {request.name}: {answer.refused}")
            else:
                self.say(f"{request.name} claimed {who(INFERENCE, answer.rank)}")

    def decide(self, request: Claim, there: Callable[[int], bool]) -> Answer:
        url = request.server
        try:
            served, reference = FlatLayout.from_json(request.layout), self.reference()
            if reference is not None:
                reference.check_matches(served, what=f"the vLLM server at {url}")
        except (LayoutMismatch, ValueError, KeyError, TypeError) as e:
            return Answer(refused=f"the vLLM server at {url} serves another model than job {self.job}: {e}; serve "
                                  "spec.model (its config or checkpoint) in spec.model.dtype (--dtype)")
        replica = self.replicas.get(url)
        sizes = [len(self._ranks(r)) for r in range(self.layout.replicas(INFERENCE))]
        fits = {r for r, size in enumerate(sizes) if size == request.workers and (replica is None or r == replica)}
        if not fits:
            want = sizes[replica] if replica is not None else " or ".join(str(n) for n in sorted(set(sizes)))
            return Answer(refused=f"the vLLM server at {url} runs {request.workers} workers, but job {self.job}'s "
                                  f"servers run {want} (spec.inference.tensorParallel, tensorParallelSizes): start "
                                  f"it with --tensor-parallel-size {want}")
        if replica is not None:
            rank = self._ranks(replica)[request.worker]
            if self.holders.get(rank) == url and self._there(rank, there):
                return Answer(refused=f"the vLLM server at {url} already joined job {self.job} as {who(INFERENCE, rank)}"
                                      " and is still there: a server joins a job once (is WEIGHTSYNC_VLLM_SERVER this "
                                      "server's own URL?)")
            return self._give(url, replica, request.worker)
        taken = set(self.replicas.values())
        free = [r for r in sorted(fits) if r not in taken]
        if free:
            return self._give(url, free[0], request.worker)
        for old, replica in sorted(self.replicas.items(), key=lambda kv: kv[1]):
            if replica not in fits:
                continue
            held = [rank for rank, holder in self.holders.items() if holder == old]
            if held and not any(self._there(rank, there) for rank in held):
                self.say(f"the vLLM server at {url} takes over replica {replica} from {old}, which is away")
                del self.replicas[old]
                for rank in held:
                    del self.holders[rank]
                return self._give(url, replica, request.worker)
        servers = ", ".join(sorted(u for u, r in self.replicas.items() if r in fits))
        of = "" if len(set(sizes)) == 1 else f" of {request.workers} workers"
        return Answer(refused=f"job {self.job} is full: its {len(fits)} inference servers{of} "
                              f"(spec.inference.replicas) have joined ({servers}) and are there; a server joins "
                              "only in place of one that stopped")

    def _there(self, rank: int, there: Callable[[int], bool]) -> bool:
        return there(rank) or time.monotonic() - self.granted.get(rank, -ARRIVAL) < ARRIVAL

    def _ranks(self, replica: int) -> range:
        return self.layout.ranks_of(self.layout.first_ordinal(INFERENCE) + replica)

    def _give(self, url: str, replica: int, worker: int) -> Answer:
        rank = self._ranks(replica)[worker]
        self.replicas[url] = replica
        self.holders[rank] = url
        self.granted[rank] = time.monotonic()
        return Answer(rank=rank)
