"""A job's status as the operator owns it (phase, conditions, per-role replicas with their
restarts and rejoins), computed from what the cluster shows and what the job's controller pod
reported: pure functions, so that every handler writes the same answer."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Mapping

from weightsync.job import CONTROLLER, INFERENCE, ROLES, TRAINER, Layout, reasons, states
from weightsync.job.states import CONDITIONS, Condition
from weightsync_operator.queueing import Admission

# Ready reasons that deserve no Event: the usual way to and from running.
QUIET = (reasons.PODS_NOT_READY, reasons.FINISHED, reasons.SUSPENDED, reasons.QUEUED)
# Container waiting reasons (Kubernetes' own) that mean a pod will not run without someone's help.
WAITING_PROBLEMS = {
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError", "CrashLoopBackOff", "RunContainerError",
}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, ok: bool, reason: str, message: str) -> dict:
    """A condition of type `kind` (weightsync/job/states.py: Condition; reasons: weightsync/job/reasons.py)."""
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def pod_problem(pod_status: Mapping) -> tuple[str, str] | None:
    """(reason, message) when a pod is stuck for a reason someone must fix, else None."""
    for c in pod_status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return "Unschedulable", c.get("message") or "no node can run the pod"
    statuses = list(pod_status.get("initContainerStatuses") or []) + list(pod_status.get("containerStatuses") or [])
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_PROBLEMS:
            return waiting["reason"], waiting.get("message") or f"container {cs.get('name')} is waiting: {waiting['reason']}"
    return None


def restarts(pod_status: Mapping) -> int:
    """A pod's container restarts, as kubectl's RESTARTS column counts them."""
    return sum(int(cs.get("restartCount") or 0) for cs in pod_status.get("containerStatuses") or [])


def compute(current: Mapping, layout: Layout, statefulsets: Mapping[str, Mapping],
            problems: Iterable[tuple[str, str, str]], set_conditions: Iterable[Mapping] = (),
            at: str | None = None, pod_restarts: Mapping[str, int] | None = None,
            external: Iterable[str] = (), suspended: bool = False, queued: Admission | None = None,
            running: Mapping[str, int] | None = None) -> dict:
    """The operator-owned part of the status.

    current: the job's status now (the controller pod's `completion` and `rejoins` included);
    statefulsets: role -> {"ready": int} for the StatefulSets that exist;
    problems: (what, reason, message) of the job's stuck pods ("pod x") and of StatefulSets that
    cannot create theirs ("StatefulSet y");
    set_conditions: conditions the caller decided (NetworkResolved, ChildrenCreated);
    pod_restarts: role -> the container restarts of the role's pods now. A finished job's pods
    are gone: its status keeps the counts it had;
    external: the roles whose processes the user starts (spec.<role>.external). The operator
    runs no pod of theirs, so it wants none ready: their replicas say "external" with the ranks
    the job waits for (whether those joined, the controller's log says), and Ready is about the
    operator's own pods;
    suspended: spec.suspend, so the job wants no pods: its phase is Suspended (what it delivered
    stays in the status), and the Suspended condition says whether it is;
    queued: where a job that names a Kueue queue stands (None: it names none). Until Kueue admits
    it, and after Kueue evicts it, it wants no pods either: its phase is Queued, and the Admitted
    condition says why, in Kueue's words;
    running: the pods a role runs now where fewer than the layout holds ranks for (Job.running_pods:
    spec.inference.replicas below maxReplicas)."""
    external = set(external)
    wants = Wants(completion=current.get("completion") or {}, suspended=suspended, queued=queued)
    at = at or now()
    conditions = {c["type"]: dict(c) for c in current.get("conditions") or []}
    for c in set_conditions:
        conditions[c["type"]] = dict(c)

    replicas = {}
    before = current.get("replicas") or {}
    rejoins = current.get("rejoins") or {}
    for role in ROLES:
        if role in external:
            replicas[role] = {"ready": 0, "desired": 0, "summary": f"external ({layout.world_size(role)} ranks)",
                              "restarts": 0, "rejoins": int(rejoins.get(role) or 0)}
            continue
        desired = 0 if wants.stopped else (running or {}).get(role, layout.replicas(role))
        ready = min(int((statefulsets.get(role) or {}).get("ready") or 0), desired)
        restarted = int((pod_restarts or {}).get(role) or 0)
        if wants.stopped:  # its pods are going or gone
            restarted = max(restarted, int((before.get(role) or {}).get("restarts") or 0))
        replicas[role] = {"ready": ready, "desired": desired, "summary": f"{ready}/{desired}",
                          "restarts": restarted, "rejoins": int(rejoins.get(role) or 0)}
    all_ready = not wants.stopped and all(replicas[r]["ready"] == replicas[r]["desired"] for r in ROLES)

    conditions[Condition.SUSPENDED] = _suspended(wants, conditions.get(Condition.SUSPENDED))
    conditions[Condition.ADMITTED] = _admitted(wants, conditions.get(Condition.ADMITTED))
    conditions[Condition.READY] = (condition(Condition.READY, True, reasons.ALL_PODS_READY,
                                             _counts(replicas, layout, external)) if all_ready
                                   else _not_ready(wants, replicas, sorted(problems)))
    conditions[Condition.COMPLETED] = _completed(wants, conditions.get(Condition.COMPLETED))
    conditions[Condition.FAILED] = _failed(wants, conditions.get(Condition.CHILDREN_CREATED))
    conditions = {kind: c for kind, c in conditions.items() if c is not None}
    phase = _phase(wants, current.get("phase"), conditions, all_ready)

    old = {c["type"]: c for c in current.get("conditions") or []}
    merged = []
    for kind, c in conditions.items():
        before = old.get(kind)
        c["lastTransitionTime"] = (before["lastTransitionTime"] if before and before.get("status") == c["status"]
                                   and before.get("lastTransitionTime") else at)
        merged.append(c)
    merged.sort(key=lambda c: _ORDER.get(c["type"], len(_ORDER)))
    return {"phase": phase, "conditions": merged, "replicas": replicas}


_ORDER = {t: i for i, t in enumerate(CONDITIONS)}


@dataclass(frozen=True)
class Wants:
    """What a job wants now, from its spec (suspend, its Kueue queue) and its controller's report
    (completion): the inputs every condition and the phase are computed from."""

    completion: Mapping
    suspended: bool
    queued: Admission | None

    @property
    def finished(self) -> bool:
        return states.ended(self.completion.get("state"))

    @property
    def held(self) -> bool:
        """Not admitted by its Kueue queue (a suspended job is suspended first)."""
        return self.queued is not None and self.queued.held and not self.suspended

    @property
    def stopped(self) -> bool:
        """It wants no pods: finished, suspended or held."""
        return self.finished or self.suspended or self.held


def _suspended(wants: Wants, old: dict | None) -> dict | None:
    """Suspended: True while spec.suspend is; False (Resumed) once it turns false again."""
    if wants.suspended and not wants.finished:
        return condition(Condition.SUSPENDED, True, reasons.SUSPENDED,
                         "spec.suspend is true: the job runs no pods until it is false")
    if old is not None and old["status"] == "True":
        return condition(Condition.SUSPENDED, False, reasons.RESUMED,
                         "spec.suspend is false: the job starts again from its beginning")
    return old


def _admitted(wants: Wants, old: dict | None) -> dict | None:
    """Admitted: where a job that names a Kueue queue stands, in Kueue's words (kept once it ends)."""
    queued = wants.queued
    if queued is None or wants.finished:
        return old
    if queued.admitted:
        return condition(Condition.ADMITTED, True, reasons.ADMITTED, queued.message)
    if not wants.suspended:
        return condition(Condition.ADMITTED, False, reasons.EVICTED if queued.evicted else reasons.QUEUED,
                         queued.message)
    return old


def _not_ready(wants: Wants, replicas: Mapping, problems: list[tuple[str, str, str]]) -> dict:
    """Ready when not every pod is: why the job runs none, else the first stuck pod, else the counts."""
    if wants.finished:
        return condition(Condition.READY, False, reasons.FINISHED,
                         "the job finished; its StatefulSets are scaled to zero")
    if wants.suspended:
        return condition(Condition.READY, False, reasons.SUSPENDED, "the job is suspended; its StatefulSets are "
                                                                    "scaled to zero")
    if wants.held:
        return condition(Condition.READY, False, reasons.QUEUED, "the job is not admitted by its Kueue queue; "
                                                                 "its StatefulSets are scaled to zero")
    if problems:
        what, reason, message = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return condition(Condition.READY, False, reason, f"{what}: {message}{more}")
    ready = ", ".join(f"{r} {replicas[r]['summary']}" for r in ROLES)
    return condition(Condition.READY, False, reasons.PODS_NOT_READY, f"ready pods: {ready}")


def _completed(wants: Wants, old: dict | None) -> dict | None:
    """Completed: set once, when the controller reports the job succeeded."""
    if wants.completion.get("state") == states.SUCCEEDED:
        return condition(Condition.COMPLETED, True, reasons.SUCCEEDED, _completion_message(wants.completion))
    return old


def _failed(wants: Wants, created: dict | None) -> dict | None:
    """Failed: the controller's reason, or a child no retry can create; absent otherwise."""
    if wants.completion.get("state") == states.FAILED:
        return condition(Condition.FAILED, True, wants.completion.get("reason") or reasons.WORKERS_FAILED,
                         _completion_message(wants.completion))
    if created and created["status"] == "False" and created.get("reason") in reasons.PERMANENT:
        return condition(Condition.FAILED, True, created["reason"], created.get("message", ""))
    return None


def _phase(wants: Wants, before: str | None, conditions: Mapping[str, dict], all_ready: bool) -> str:
    """status.phase, from what the job wants and its conditions."""
    if wants.finished:
        return wants.completion["state"]
    if wants.suspended:
        return states.SUSPENDED
    if wants.held:
        return states.QUEUED
    if Condition.FAILED in conditions:
        return states.FAILED
    created = conditions.get(Condition.CHILDREN_CREATED)
    if all_ready or (before == states.RUNNING and created and created["status"] == "True"):
        # A restarting pod does not send a running job back to Pending: Ready says what is wrong.
        return states.RUNNING
    return states.PENDING


def _counts(replicas: Mapping, layout: Layout, external: set[str]) -> str:
    """What Ready says when it is True: the pods that are ready, and the ranks the operator does
    not run."""
    r = {role: replicas[role]["desired"] for role in ROLES}
    if not external:
        return f"{r[CONTROLLER]} controller, {r[TRAINER]} trainer and {r[INFERENCE]} inference pods are ready"
    ours = [role for role in ROLES if role not in external]
    pods = " and ".join(f"{r[role]} {role}" for role in ours)
    theirs = " and ".join(f"{layout.world_size(role)} {role} ranks" for role in ROLES if role in external)
    return f"{pods} pods are ready; the {theirs} are external (your own processes: the controller's log says which joined)"


def _completion_message(completion: Mapping) -> str:
    message = completion.get("message") or ""
    if completion.get("versions") is not None:
        message = f"{completion['versions']} weight versions delivered" + (f": {message}" if message else "")
    return message or f"the job's controller reported {completion.get('state')}"


def changes(current: Mapping, new: Mapping) -> dict:
    """The top-level status fields whose values differ (what a merge patch must carry)."""
    return {k: v for k, v in new.items() if current.get(k) != v}


# The phases that deserve an Event when a job enters them, each with the condition whose message it gives.
_SAID_BY = {states.RUNNING: Condition.READY, states.SUCCEEDED: Condition.COMPLETED, states.FAILED: Condition.FAILED,
            states.SUSPENDED: Condition.SUSPENDED}


def events(current: Mapping, new: Mapping) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Kubernetes Events that the change from `current` to `new`
    deserves: a chosen network, a condition turning bad, a new phase."""
    old = {c["type"]: c for c in current.get("conditions") or []}
    out = []
    for c in new.get("conditions", []):
        before = old.get(c["type"])
        if before and (before.get("status"), before.get("reason")) == (c["status"], c.get("reason")):
            continue
        if c["type"] == Condition.NETWORK_RESOLVED:
            out.append(("Normal", Condition.NETWORK_RESOLVED, c.get("message", "")))
        elif (c["status"] == "False" and c["type"] in (Condition.CHILDREN_CREATED, Condition.READY)
              and c.get("reason") not in QUIET):
            out.append(("Warning", c["reason"], c.get("message", "")))
        elif c["type"] == Condition.ADMITTED:  # admitted, and each time it waits again or is evicted
            out.append(("Warning" if c.get("reason") == reasons.EVICTED else "Normal", c["reason"], c.get("message", "")))
    phase = new.get("phase")
    if phase in _SAID_BY and phase != current.get("phase"):
        by_type = {c["type"]: c for c in new.get("conditions", [])}
        source = by_type.get(_SAID_BY[phase]) or {}
        message = source.get("message", "")
        if phase == states.FAILED and source.get("reason"):
            message = f"{source['reason']}: {message}"
        out.append(("Warning" if phase == states.FAILED else "Normal", phase, message))
    return out


# Events of the inference ranks (status.receivers, from the job's controller pod).
JOINED, RANK_AWAY, RANK_REJOINED, RANK_DROPPED = "AllRanksJoined", "RankAway", "RankRejoined", "RankDropped"
THERE = ("current", "behind")


def receiver_events(old: Mapping | None, new: Mapping | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events that a change of status.receivers deserves: every
    inference rank joined (the first report), a rank away, a rank back, never one per version.
    A job too large to list its ranks gets them from the counts."""
    old, new = old or {}, new or {}
    if not new:
        return []
    if not old:
        return [("Normal", JOINED, f"all {new.get('total', 0)} inference ranks joined the job")]
    before = {r["rank"]: r for r in old.get("ranks") or []}
    out = []
    if new.get("ranks") is not None:
        for r in new["ranks"]:
            was = (before.get(r["rank"]) or {}).get("state")
            pod = f" (pod {r['pod']})" if r.get("pod") else ""
            if r["state"] == "away" and was != "away":
                out.append(("Warning", RANK_AWAY, f"inference rank {r['rank']}{pod} is away; the job goes on "
                            "without it and takes it back when it returns"))
            elif r["state"] == "dropped" and was != "dropped":
                out.append(("Warning", RANK_DROPPED, f"inference rank {r['rank']}{pod} was away past "
                            "spec.inference.awayGraceSeconds and is dropped: the job goes on without waiting for "
                            "it (spec.inference.minAvailable) and takes it back if it starts again"))
            elif r["state"] in THERE and was in ("away", "rejoining", "dropped"):
                out.append(("Normal", RANK_REJOINED, f"inference rank {r['rank']}{pod} rejoined the job"))
        return out
    away, was_away = int(new.get("away") or 0), int(old.get("away") or 0)
    if away > was_away:
        out.append(("Warning", RANK_AWAY, f"{away - was_away} more inference ranks are away ({away} of "
                    f"{new.get('total')}); the job goes on without them and takes them back when they return"))
    dropped, was_dropped = int(new.get("dropped") or 0), int(old.get("dropped") or 0)
    if dropped > was_dropped:
        out.append(("Warning", RANK_DROPPED, f"{dropped - was_dropped} more inference ranks are dropped ({dropped} of "
                    f"{new.get('total')}): away past spec.inference.awayGraceSeconds, no longer waited for"))
    gone = ("away", "rejoining", "dropped")
    back = sum(int(old.get(s) or 0) for s in gone) - sum(int(new.get(s) or 0) for s in gone)
    if back > 0:
        out.append(("Normal", RANK_REJOINED, f"{back} inference ranks rejoined the job"))
    return out
