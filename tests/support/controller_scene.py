"""The job's real controller (roles/controller's Controller, with a real Host on loopback) on a
thread of the test's process, and its ranks as threads that speak the real protocol to it, so
that a test can script what a rank does at a version and read what the controller decided.

The ranks move no weights: bench/sim_ranks.Wire stands in for the bytes (each trainer reports the
checksums of its buckets, each receiver the digest of what it got, which the controller checks
as it checks real ones), and an inference rank takes its rounds through runtime.inbound's
receive_rounds, the real ranks' code. What the controller decided is read where the operator reads
it: its status file, its one-line records, and its lines. Only the times are shortened: the Host
takes the rules the job's spec gives (driver.policy_of), with heartbeat and away limits of
seconds, so that a silent rank is seen within the test's time.
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from support.jobs import TINY
from support.paths import Path as Traced
from support.paths import holding
from support.roster import TOKEN
from weightsync.bench.sim_ranks import Wire
from weightsync.job import API_VERSION, CONTROLLER, INFERENCE, KIND, TRAINER, WorkerContext, load_job, reasons
from weightsync.model.flat import FlatLayout
from weightsync.plan.sliced_plan import plan_from_json
from weightsync.rendezvous.messages import RankFailure, RankInfo
from weightsync.rendezvous.protocol import JobEnded, Keys, Member, Restarted, Resuming
from weightsync.rendezvous.roster import Host
from weightsync.roles.controller.driver import Controller, policy_of
from weightsync.roles.controller.planning import external_deadlines
from weightsync.roles.controller.records import Reporter
from weightsync.runtime.inbound import LoadFailed, ReceivedVersion, StartAgain, receive_rounds

DRIVER = Controller.__module__
WAIT = 30.0  # seconds any one wait of a simulated rank, or the whole scene, may take
LAYOUT = FlatLayout.from_shapes([("w", (16, 16)), ("b", (16,))], "bfloat16")

# what a rank does at a version (Act.what); a trainer does it before it says it is ready for the
# version, but SENDING, which it does once the go came and before it reports the version sent;
# an inference rank as it receives the version, but LOAD_FAILS, as its engine loads it
SILENT = "freezes"  # its heartbeat stops, and it answers nothing until the job ends
FAILS = "fails"  # it reports a failure (TransferError), and its pod says goodbye at the end
RESTARTS = "restarts"  # its process dies and starts again (a new attempt, joining anew)
SENDING = "restarts sending"  # a trainer's process dies while the version is on its way, and starts again
LOAD_FAILS = "load fails"  # its engine fails part-way through loading, back on the version it held
BACK = "waits for a rank back"  # a trainer is ready for the version once the controller took a rank back
CLOSES = "closes"  # a trainer publishes no more versions: it closes after the one before


@dataclass(frozen=True)
class Act:
    """What one rank does at one version."""

    role: str
    rank: int
    version: int
    what: str


@dataclass(frozen=True)
class Spec:
    """The job the controller runs, as far as a case changes it."""

    trainers: int = 1
    inferences: int = 2
    versions: int = 3  # the trainers publish 0..versions-1, then close
    resumes: bool = False  # the trainers run a user's script that resumes from its checkpoint
    min_available: int | None = None
    on_load_failure: str = "rollBack"
    starts: int = 1  # the controller's start (a later one finds the job's earlier start)
    silent: float = 3.0  # seconds without a heartbeat that count a rank as silent (HEARTBEAT is 1 s)
    away: float = 1.0  # seconds an inference rank may be away before it is dropped


@dataclass
class Outcome:
    """What the controller decided, where the operator and the user read it."""

    code: int  # the controller's exit code
    status: dict  # the job's status as the controller last wrote it
    records: list[dict]  # its one-line records (stdout)
    said: list[str]  # its lines

    @property
    def completion(self) -> dict:
        return self.status["completion"]

    def transfers(self) -> list[tuple[int, int, int]]:
        """(version, again, inference ranks that applied it) of every round, in order."""
        return [(r["version"], r.get("again", 0), r["inference_ranks"]) for r in self.records if r["event"] == "transfer"]


def job_of(spec: Spec):
    trainer = {"replicas": spec.trainers, "procsPerPod": 1, "gpusPerProc": 0}
    if spec.resumes:
        trainer["command"] = ["python", "train.py"]
    inference = {"replicas": spec.inferences, "procsPerPod": 1, "gpusPerProc": 0, "onLoadFailure": spec.on_load_failure}
    if spec.min_available is not None:
        inference["minAvailable"] = spec.min_available
    return load_job({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "controller-scene"},
                     "spec": {"model": {"config": TINY, "dtype": "bfloat16"}, "trainer": trainer, "inference": inference,
                              "training": {"steps": spec.versions},
                              "transfer": {"bucketMB": 1, "transport": "tcp", "timeoutSeconds": 20},
                              "network": {"mode": "tcp"}}})


def context(job, port: int) -> WorkerContext:
    """The controller's context for `job`, its store on loopback at `port`."""
    return WorkerContext(job=job, ordinal=0, role=CONTROLLER, pod_ip="127.0.0.1", controller_host="127.0.0.1",
                         store_port=port, data_port=0, network_mode="tcp", token=TOKEN, report_to_kubernetes=False,
                         health_port=0)


class Scene:
    """One job: its controller, over a Host built here (the rules its spec gives, with short
    times), and its ranks, each doing what `acts` say at their versions."""

    def __init__(self, spec: Spec, acts: tuple[Act, ...], folder: Path, traced: Traced | None = None):
        self.spec, self.acts, self.folder = spec, {(a.role, a.rank, a.version): a.what for a in acts}, folder
        self.job = job_of(spec)
        self.said: list[str] = []
        rules = context(self.job, 0)
        policy = dataclasses.replace(policy_of(rules, external_deadlines(self.job)), silent_limit=spec.silent,
                                     trainer_silent_limit=spec.silent, away_limit=spec.away)
        self.host = Host(0, TOKEN, self.job.layout, policy, say=self.said.append, address="127.0.0.1",
                         job=self.job.identity)
        ctx = dataclasses.replace(rules, store_port=self.host.store.port)
        self.out = io.StringIO()
        self.reporter = Reporter(self.job, False, out=self.out, status_file=str(folder / "status.json"))
        self.traced, self.ctx = traced, ctx  # with `traced`: the context's path through the controller, followed
        self.controller = self._followed(lambda: _Heard(ctx, self.reporter, host=self.host), "Controller.__init__")
        self.controller.heard = self.said
        self.done: set[tuple[str, int, int]] = set()  # the acts done, by (role, rank, version): each is done once
        self.errors: list[str] = []  # what a simulated rank did not expect

    def run(self) -> Outcome:
        ranks = [threading.Thread(target=self._life, args=(role, rank), daemon=True, name=f"{role}-{rank}")
                 for role, n in ((TRAINER, self.spec.trainers), (INFERENCE, self.spec.inferences)) for rank in range(n)]
        for t in ranks:
            t.start()
        code = []
        controller = threading.Thread(target=lambda: code.append(self._followed(
            lambda: self.controller.run(self.spec.starts, {}), "Controller.run")), daemon=True)
        controller.start()
        try:
            controller.join(WAIT)
            assert code, f"the controller did not end the job within {WAIT:.0f}s: {self.said[-5:]}"
            for t in ranks:
                t.join(WAIT)
            assert not [t.name for t in ranks if t.is_alive()], "a simulated rank outlived the job"
        finally:
            self.host.store.close()
        assert not self.errors, self.errors
        assert self.done == set(self.acts), f"acts that never came to pass: {sorted(set(self.acts) - self.done)}"
        status = json.loads((self.folder / "status.json").read_text())
        return Outcome(code[0], status, [json.loads(line) for line in self.out.getvalue().splitlines()], self.said)

    def _followed(self, run, function: str):
        """run(), the controller's context followed from its `function` on where the scene is traced."""
        return run() if self.traced is None else self.traced.traced(run, DRIVER, function, holding(self.ctx))

    # ------------------------------------------------------------ a rank's processes

    def _process(self, role: str, rank: int) -> Member:
        """A process of the rank, not yet started."""
        return Member("127.0.0.1", self.host.store.port, TOKEN, role, rank, timeout=WAIT, job=self.job.identity)

    def _join(self, member: Member) -> None:
        """The process counts its start (Restarted: a trainer's that does not resume), beats, and joins."""
        member.arrive(resumes=self.job.trainer.resumes)
        member.start_heartbeat()
        info = RankInfo("tcp", "simulated", "cpu", f"{member.role}-{member.rank}")
        member.join(f"127.0.0.1:{1000 + member.rank}", LAYOUT.to_json(), info, WAIT)
        if member.role == TRAINER and self.job.trainer.resumes:
            member.watch_resumes()

    def _life(self, role: str, rank: int) -> None:
        """The rank's processes, one after the other, until the job ends; then its goodbye (its
        pod's, for a process that failed), but from a frozen one."""
        member = self._process(role, rank)
        try:
            self._join(member)
            first = 0
            while True:
                try:
                    (self._trainer if role == TRAINER else self._inference)(member, rank, first)
                    break  # the job ended
                except (_Died, Resuming, StartAgain):  # it starts again (a Resuming trainer with the others)
                    member.stop_heartbeat()
                    member.close()
                    member = self._process(role, rank)
                    self._join(member)
                    first = member.resumed(WAIT).version if role == TRAINER else 0
        except (JobEnded, _Ended):
            pass
        except Restarted:  # a trainer's new start, where the trainers do not resume: the job ends
            member.wait_for_end(WAIT)
        except LoadFailed as e:  # onLoadFailure failJob: the rank fails, reporting why
            member.fail(e)
            member.wait_for_end(WAIT)
        except _Frozen:
            member.wait_for_end(WAIT)
            member.close()
            return
        except Exception as e:  # noqa: BLE001 - kept for the test, which fails naming it
            self.errors.append(f"{role} rank {rank}: {type(e).__name__}: {e}")
        member.bye()
        member.stop_heartbeat()
        member.close()

    def _act(self, member: Member, role: str, rank: int, version: int, when: tuple[str, ...]) -> None:
        what = self.acts.get((role, rank, version))
        if what not in when or (role, rank, version) in self.done:
            return
        self.done.add((role, rank, version))
        if what == SILENT:
            member.stop_heartbeat()
            raise _Frozen()
        if what == FAILS:
            member.fail(RankFailure(reasons.TRANSPORT_ERROR, f"TransferError: the connection reset at version {version}"))
            member.wait_for_end(WAIT)
            raise _Ended()
        if what in (RESTARTS, SENDING):
            raise _Died()
        if what == BACK:  # the endpoints of a later epoch: the controller took an inference rank back
            member.wait_for(Keys.peers(1) + "/mac", "an inference rank taken back", WAIT)
            return
        if what == CLOSES:
            member.closing(version - 1)
            member.wait_for_end(WAIT)
            raise _Ended()
        if what == LOAD_FAILS:
            raise LoadFailed(f"the engine failed part-way through loading version {version}", holds=version - 1)

    def _trainer(self, member: Member, rank: int, first: int) -> None:
        """A trainer rank from version `first`: ready, the go, its report of the round; then
        closed, answering repeats of the final version until the end (as the trainer API does)."""
        last = self.spec.versions - 1
        wire = Wire.of(plan_from_json(member.plan_text(WAIT)))
        for version in range(first, self.spec.versions):
            self._act(member, TRAINER, rank, version, (SILENT, FAILS, RESTARTS, CLOSES, BACK))
            member.ready(version, 10 * version)
            rnd = member.round(version, timeout=WAIT)
            self._act(member, TRAINER, rank, version, (SENDING,))
            member.say_sent(rnd, wire.sent(rank, rnd, 0.0))
        member.closing(last)
        again = 1
        while True:
            rnd = member.round(last, again)  # JobEnded at the end
            member.say_sent(rnd, wire.sent(rank, rnd, 0.0))
            again += 1

    def _inference(self, member: Member, rank: int, first: int) -> None:
        wire = Wire.of(plan_from_json(member.plan_text(WAIT)))
        receive_rounds(member, _Receiver(self, member, rank, wire), self.job, _Engine(self, member, rank))


class _Heard(Controller):
    """The controller, its lines kept (in `heard`) besides logged, as the Host's are."""

    heard: list[str]

    def say(self, message: str) -> None:
        self.heard.append(message)
        super().say(message)


class _Died(Exception):
    """The rank's process died (it starts again)."""


class _Ended(Exception):
    """The rank saw the job's end."""


class _Frozen(Exception):
    """The rank's process froze (it answers nothing until the job ends)."""


@dataclass
class _Receiver:
    """An inference rank's end of the transport: every bucket the plan gives it comes at once."""

    scene: Scene
    member: Member
    rank: int
    wire: Wire

    def receive(self, version: int, staging, timeout: float, base=None) -> ReceivedVersion:
        self.scene._act(self.member, INFERENCE, self.rank, version, (SILENT, FAILS, RESTARTS))
        return self.wire.received(version, self.rank, 0.0)


@dataclass
class _Engine:
    """An inference rank's engine (inbound.Handover): it loads nothing, or fails as its acts say."""

    scene: Scene
    member: Member
    rank: int
    offered: list = field(default_factory=list)

    def staging(self):
        return None

    def base(self, version: int | None):
        return None

    def offer(self, version: int, got: ReceivedVersion) -> None:
        self.scene._act(self.member, INFERENCE, self.rank, version, (LOAD_FAILS,))
        return None
