"""The controller's side of the rendezvous: it hosts the store, admits the ranks that prove the
job token, and keeps the roster of inference ranks from one round to the next.

Inference pods are StatefulSet pods: one that dies (an OOM kill, a node drain, a preemption) is
started again under the same name and ordinal. So an inference rank that vanishes does not end
the job: it is "away" and the versions go on to the others; when its process starts again it
joins anew (a fresh challenge for its new attempt, a new endpoint), waits, and is taken back at
the next round, which it receives in full and verifies before it serves. A rank away for longer
than `away_limit` fails the job. The same holds while the ranks join (join_phase.py): the
controller admits each rank's latest start, so an inference pod killed while it loads its model
joins with its next start, and the first round takes it back. Trainers do not come back: a
trainer that restarts, or goes silent, fails the job, while the ranks join as later (the built-in
trainer keeps no checkpoint to resume from; see the README). The inference pods of a running job
may be scaled: the ranks beyond the pods it runs are parked (parking.py). A tensor-parallel
replica of the built-in engine goes away and comes back as a whole (policy.tp_replicas): its ranks
compute over a process group formed when they start, which takes back no single rank; so the
others are counted away with the first (each start learns it, ends and starts again), and the
replica is taken back once every rank of it joined with its new start, under a new group.

Its parts: the rounds (rounds.py), the watch over the ranks' heartbeats, restarts and failures
(watch.py), the end of the job (ending.py) and the scaling of the inference pods (parking.py);
this module admits the ranks, publishes the plan and keeps the seats of the inference ranks.
"""

from __future__ import annotations

import copy
import json
import secrets
import sys
import time
from typing import Callable, Mapping

from weightsync.job import ANNOTATION_NETWORK_MODE, INFERENCE, TRAINER, Job, Layout, reasons
from weightsync.model.flat import FlatLayout
from weightsync.rendezvous.channel import Channel, host_store
from weightsync.rendezvous.claims import Claims
from weightsync.rendezvous.ending import Ending
from weightsync.rendezvous.join_phase import PROGRESS_EVERY, Deadline, Joining, RankFailed
from weightsync.rendezvous.messages import (
    Admission,
    Cut,
    Number,
    Peer,
    PublishedPlan,
    RankInfo,
    ResumePoint,
    Round,
    Text,
    peers_to_json,
)
from weightsync.rendezvous.parking import Parking
from weightsync.rendezvous.policy import Policy
from weightsync.rendezvous.proofs import job_mac, peers_mac, plan_mac
from weightsync.rendezvous.protocol import Keys, ranks_of, who
from weightsync.rendezvous.rounds import Rounds
from weightsync.rendezvous.seats import AWAY, DROPPED, JOINING, PARKED, SERVING, WAITING, Seat
from weightsync.rendezvous.watch import Beat, Watching


class Host(Ending, Rounds, Watching, Channel, Parking):  # Ending's end() says the end, where a Channel's reads it
    """The controller's side: hosts the store, admits ranks, keeps the roster, watches ranks."""

    def __init__(self, port: int, token: bytes, layout: Layout, policy: Policy,
                 say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True), *, address: str, job: str):
        super().__init__(host_store(address, port, token, job, len(ranks_of(layout))))
        self.token, self.layout, self.say, self.policy = token, layout, say, policy
        self.ranks = ranks_of(layout)
        # the inference ranks of the pods it runs (spec.inference.replicas'); the rest are parked
        self.running = layout.world_size(INFERENCE) if policy.running is None else policy.running
        self.wanted: int | None = None  # the running ranks as last read from the job, where it can be scaled
        self.parked = set(range(self.running, layout.world_size(INFERENCE)))
        # a parked rank has not started: its first start is one more than none
        self.attempts = {(role, rank): 0 if role == INFERENCE and rank in self.parked else 1 for role, rank in self.ranks}
        # the latest start of a rank that was refused (a second process claiming an external trainer's
        # rank while the one that holds it is alive): counted, but not the rank's attempt
        self.refused: dict[tuple[str, int], int] = {}
        self.seats: dict[int, Seat] = {}
        self.epoch = 0
        self.in_round: dict[int, int] = {}  # receivers of the current round: {rank: attempt}
        self.round: Round | None = None  # the current round
        self.cut: set[int] = set()  # receivers of the current round counted away during it
        # what a rank that rejoins the running job must match (the plan's model, transport and
        # slices): given with the plan (publish_plan)
        self.check_rejoin: Callable[[int, str, RankInfo], None] = lambda rank, meta, info: None
        self.published = False  # the plan: the ranks joined, and the versions may start
        # where the trainers resume (policy.resumable): {trainer rank: the start it runs}
        self.trainers_run: dict[int, int] = {}
        self.resumes = 0  # the times they resumed
        # external vLLM servers: their workers claim inference ranks (claims.py)
        self.claims = Claims(layout, job, self.trainer_layout, say) if INFERENCE in policy.external else None
        self.failures_seen = 0
        self.deferred = False  # a trainer rank's failure seen while only the inference ranks were checked
        self.beats: dict[tuple[str, int], Beat] = {}
        self._looks: dict[tuple, list[str]] = {}  # the keys Watching.look reads, by the ranks it looks at
        self.departures: dict[int, int] = {}  # {a TP replica's first rank: the times it went away} (Keys.replica)
        self.last_watch = 0.0
        for role, rank in self.ranks:
            if self.attempts[(role, rank)]:  # a parked rank's challenge is made when it starts
                self.set(Keys.nonce(role, rank, 1), Text(secrets.token_hex(16)))

    @property
    def resuming(self) -> bool:
        """Whether a trainer rank that stops is resumed from (policy.resumable) rather than failing
        the job: once the plan is published; while the ranks join, a trainer that stops fails it."""
        return self.policy.resumable and self.published

    @property
    def needed(self) -> int:
        """Inference ranks the job cannot go on without: minAvailable, or every running one."""
        return self.running if self.policy.min_available is None else self.policy.min_available

    # ------------------------------------------------------------ the trainers' resumes (resume.py)

    def begin_resume(self, version: int) -> int:
        """The trainers begin to resume, `version` next: the processes of their earlier starts
        that still wait on weightsync end (Keys.RESUMING), and what those said they were ready
        with is forgotten. Returns the resumes begun so far."""
        resumes = self.store.add(Keys.RESUMING, 1)  # before any challenge: a process of this start must not see it
        for t in range(self.layout.world_size(TRAINER)):
            self.store.delete_key(Keys.ready(version, t))
        return resumes

    def trainers_running(self) -> dict[int, int]:
        """{trainer rank: the start the job runs}."""
        return dict(self.trainers_run)

    def resumed(self, point: ResumePoint) -> None:
        """Every trainer rank is back, at the starts `point` names: the job runs those, their
        silence counts from now, and the trainers read where they resume."""
        self.trainers_run, self.resumes = dict(point.attempts), point.resumes
        for t in point.attempts:
            self.beats.pop((TRAINER, t), None)
        self.set(Keys.RESUME, point)

    # ------------------------------------------------------------ admission

    def publish_job(self, job: Job, network_mode: str) -> None:
        """The defaulted job and its resolved network mode, signed: what an external rank reads
        instead of the spec file a pod mounts (rendezvous/external_rank.py). Before any rank is admitted."""
        obj = job.to_object()
        obj["metadata"]["annotations"] = {ANNOTATION_NETWORK_MODE: network_mode}
        text = json.dumps(obj, sort_keys=True)
        self.set(Keys.JOB, Text(text))
        self.set(Keys.JOB_MAC, Text(job_mac(self.token, job.identity, text)))  # last: a reader waits for it

    def proven(self, role: str, rank: int, attempt: int) -> Admission | None:
        """What the rank published for `attempt`, once it proved the token over it; None before."""
        if not self.has(Keys.published("proof", role, rank, attempt)):
            return None
        return self.published_by(self.token, role, rank, attempt)

    def admit(self, timeout: float, external: Mapping[str, Deadline] | None = None,
              every: float = PROGRESS_EVERY) -> dict[tuple[str, int], Admission]:
        """Wait for every rank's proof; return {(role, rank): what it published} (join_phase.py)."""
        return Joining(self, timeout, external or {}, every).run()

    def started_again(self, role: str, rank: int) -> int | None:
        """The rank's start count where its process started again since the last look (recorded
        as its attempt), else None."""
        return self.started_since(role, rank, self.store.add(Keys.join(role, rank), 0))

    def started_since(self, role: str, rank: int, started: int) -> int | None:
        """As started_again, the rank's starts read as `started` (Watching.look)."""
        if started <= self.counted(role, rank):
            return None
        self.attempts[(role, rank)] = started
        return started

    def attempt(self, role: str, rank: int) -> int:
        """The rank's latest start, as seen so far (the one admitted, or awaited)."""
        return self.attempts[(role, rank)]

    def challenge(self, role: str, rank: int, attempt: int) -> None:
        """A fresh challenge for the rank's start `attempt` to prove the token over; its silence
        counts anew from the next look (the new process beats on its own)."""
        self.set(Keys.nonce(role, rank, attempt), Text(secrets.token_hex(16)))
        self.beats.pop((role, rank), None)

    def waits_for(self) -> list[tuple[str, int]]:
        """The ranks the job waits for: all but the parked inference ranks."""
        return [(role, rank) for role, rank in self.ranks if not (role == INFERENCE and rank in self.parked)]

    def counted(self, role: str, rank: int) -> int:
        """The starts of the rank seen so far: its attempt's, or a refused later one's."""
        return max(self.attempts[(role, rank)], self.refused.get((role, rank), 0))

    def publish_plan(self, plan_json: str, endpoints: Mapping[int, str], infos: Mapping[int, RankInfo] | None = None,
                     check_rejoin: Callable[[int, str, RankInfo], None] | None = None) -> None:
        """The plan and the endpoints the ranks joined at; `check_rejoin(rank, meta, info)`: what a
        rank that rejoins the running job must match (it raises where the rank does not)."""
        if check_rejoin is not None:
            self.check_rejoin = check_rejoin
        self.published = True
        text = PublishedPlan(plan_json).to_json()
        self.set(Keys.PLAN, Text(text))
        self.set(Keys.PLAN_MAC, Text(plan_mac(self.token, text)))
        now = time.monotonic()
        # a rank admitted with a later start (its process started again while the ranks joined) is
        # a rejoined one: it waits for its welcome, which the first round says
        self.trainers_run = {t: self.attempts[(TRAINER, t)] for t in range(self.layout.world_size(TRAINER))}
        self.seats = {r: Seat(attempt=self.attempts[(INFERENCE, r)], endpoint=endpoints.get(r, ""), since=now,
                              info=(infos or {}).get(r))
                      for r in range(self.layout.world_size(INFERENCE))}
        for r, seat in self.seats.items():
            if r in self.parked or r not in endpoints:
                seat.state = PARKED
            elif seat.attempt > 1:
                seat.state, seat.rejoins = WAITING, 1
        self._publish_peers()

    def _publish_peers(self) -> None:
        text = peers_to_json({r: Peer(s.endpoint, s.attempt) for r, s in self.seats.items() if s.state != PARKED})
        self.set(Keys.peers(self.epoch), Text(text))
        self.set(Keys.peers(self.epoch) + "/mac", Text(peers_mac(self.token, self.epoch, text)))

    def trainer_layout(self) -> FlatLayout | None:
        """The layout trainer rank 0 joined with (proven), None before it joined: what an external
        vLLM server's claim is checked against (claims.py)."""
        got = self.proven(TRAINER, 0, 1)
        return None if got is None else FlatLayout.from_json(got.meta)

    def seats_now(self) -> dict[int, Seat]:
        """A copy of every inference rank's seat as it is now: what the controller's threads read
        while the roster's thread changes the seats."""
        return {r: copy.copy(seat) for r, seat in list(self.seats.items())}

    def rank_info(self, rank: int) -> RankInfo | None:
        """What inference rank `rank`'s latest admitted start told about itself."""
        return self.seats[rank].info

    def fell_back(self, rank: int, holds: int | None) -> None:
        """Inference rank `rank`'s load failed part-way, and it went back to `holds` (None: no whole
        version): it is behind, and the next version comes to it whole (onLoadFailure rollBack)."""
        self.seats[rank].holds = holds

    def there(self, rank: int) -> bool:
        """Whether the worker holding inference rank `rank` is there: admitted (or, before the plan,
        on its way) and not counted away."""
        seat = self.seats.get(rank)
        return seat is None or seat.state not in (AWAY, DROPPED, PARKED)

    # ------------------------------------------------------------ the roster

    def _away(self, rank: int, why: str) -> None:
        seat, replica = self.seats[rank], self.policy.replica_of(rank) or range(0)
        if seat.state in (SERVING, WAITING):
            if replica and all(self.seats[r].state not in (AWAY, JOINING) for r in replica if r != rank):
                # the first of its replica to go: the group its ranks form when they start again is a new one
                self.departures[replica.start] = self.departures.get(replica.start, 0) + 1
                self.set(Keys.replica(replica.start), Number(self.departures[replica.start]))
            seat.state, seat.since = AWAY, time.monotonic()
            self.set(Keys.away(rank, seat.attempt), Text(why))  # a start that is alive learns it from there
            self.say(f"{who(INFERENCE, rank)} is away: {why}; the job goes on without it until it rejoins "
                     f"(within {self.policy.away_limit:.0f}s)")
            if self.in_round.get(rank) == seat.attempt:
                self._cut(rank)
            for peer in replica:  # a replica goes as a whole: its process group cannot take back one rank
                self._away(peer, f"{who(INFERENCE, rank)} of its tensor-parallel replica is away")

    def _drop(self, rank: int) -> None:
        """An inference rank away past away_limit: dropped from the versions while at least
        min_available others remain (taken back if its process starts again, or once the start it
        was joining with joins), else RankFailed."""
        remaining = sum(1 for r, s in self.seats.items() if r != rank and s.state not in (DROPPED, PARKED))
        if remaining < self.needed:
            raise RankFailed(f"{who(INFERENCE, rank)} did not come back within {self.policy.away_limit:.0f}s after it went "
                             f"away, and the job needs {self.needed} inference ranks "
                             f"(spec.inference.minAvailable) with {remaining} left", reasons.RANK_LOST)
        seat = self.seats[rank]
        seat.late = seat.state == JOINING
        seat.state, seat.since = DROPPED, time.monotonic()
        self.say(f"{who(INFERENCE, rank)} dropped: away for more than {self.policy.away_limit:.0f}s; the job goes on with "
                 f"{remaining} inference ranks (it needs {self.needed}, spec.inference.minAvailable) and takes it "
                 f"back {'once its start joins, or ' if seat.late else ''}if its process starts again")

    def _lost(self, rank: int, why: str) -> None:
        if self.in_round.get(rank) == self.seats[rank].attempt:
            self._away(rank, why)

    def _cut(self, rank: int) -> None:
        """Tell the trainers that a receiver of the round on its way is gone: a receiver whose pod
        vanished may leave their sends to it hanging (no reset ever comes) until their timeout."""
        if self.round is not None and rank in self.in_round and rank not in self.cut:
            self.cut.add(rank)
            self.set(Keys.cut(self.round.version, self.round.again), Cut(self.cut))

    def _restarted(self, rank: int, attempt: int) -> None:
        seat = self.seats.get(rank)
        if seat is None:  # before the plan: the first admission takes the latest attempt
            raise RankFailed(f"{who(INFERENCE, rank)} restarted before the job started; it cannot be admitted twice")
        self._away(rank, f"its process started again (start {attempt})")
        if seat.state in (DROPPED, PARKED):  # back after it was dropped, or its pod scaled up to: away_limit to join in
            seat.since = time.monotonic()
        seat.attempt, seat.state, seat.holds = attempt, JOINING, None
        self.set(Keys.nonce(INFERENCE, rank, attempt), Text(secrets.token_hex(16)))

    def _readmit(self, rank: int) -> None:
        """Take the rank back once its latest start proved the token: a rank of a tensor-parallel
        replica (policy.tp_replicas) once every rank of the replica did, each with a new start."""
        members = self.policy.replica_of(rank) or range(rank, rank + 1)
        proofs = {r: self.proven(INFERENCE, r, seat.attempt) if seat.state == JOINING or (seat.state == DROPPED and seat.late)
                  else None for r, seat in ((r, self.seats[r]) for r in members)}
        if all(got is not None for got in proofs.values()):
            for r, got in proofs.items():
                self._take_back(r, got)

    def _take_back(self, rank: int, got: Admission) -> None:
        seat = self.seats[rank]
        self.check_rejoin(rank, got.meta, got.info)
        seat.endpoint, seat.state, seat.since, seat.info = got.endpoint, WAITING, time.monotonic(), got.info
        seat.late = False
        first = seat.attempt == 1  # a pod scaled up to, starting for the first time
        seat.rejoins += 0 if first else 1
        self.epoch += 1
        self._publish_peers()
        self.say(f"{who(INFERENCE, rank)} {'joined the running job' if first else 'rejoined'} (start {seat.attempt}, "
                 f"pod {got.info.pod}, at {got.endpoint}); it receives the next round in full and serves once it has "
                 "verified it")
