"""Kueue: a job labelled `kueue.x-k8s.io/queue-name` is admitted by Kueue as one Workload, so that a
busy cluster never starts its trainers while its inference pods wait for GPUs, holding both.

The operator is the job's integration, as every external framework of Kueue's is: it writes the
Workload (one pod set per role whose pods it runs, each with the role's pod template and count),
runs no pod of the job until Kueue admits the Workload, then starts every role at once on the node
labels and tolerations of the flavors Kueue assigned. When Kueue evicts the Workload (preempted,
deactivated), the job's pods go; once they are gone, the operator gives the quota back (the
Workload's admission cleared, as Kueue's own job integrations do) and the job waits in its queue
again; admitted again, it starts from its beginning, as after spec.suspend. A finished job
finishes its Workload, which frees its quota. spec.suspend deactivates the Workload.

The reading of a Workload and the patches are pure functions; `gate` and `read` make the
calls for the handlers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

from weightsync.job import LABEL_JOB, QUEUE_LABEL, ROLES, Job, states
from weightsync_operator.kube import ApiError, Kube, path

PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass, as Kueue's integrations read it
API_VERSION = "kueue.x-k8s.io/v1beta2"
GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta2", "workloads"
WORKLOAD, FLAVOR, PRIORITY_CLASS = "Workload", "ResourceFlavor", "WorkloadPriorityClass"
PLURALS = {WORKLOAD: "workloads", FLAVOR: "resourceflavors", PRIORITY_CLASS: "workloadpriorityclasses"}
TEMPLATE_HASH = "weightsync.io/pod-sets-hash"
# Kueue's Workload condition types and the reasons this module writes
QUOTA_RESERVED, ADMITTED, EVICTED, FINISHED, REQUEUED = "QuotaReserved", "Admitted", "Evicted", "Finished", "Requeued"
# Kueue's own reasons: QuotaReserved's while a Workload waits, and Finished's (its WorkloadFinishedReason*).
# Kueue's words, which a job's phases happen to share.
KUEUE_PENDING, KUEUE_SUCCEEDED, KUEUE_FAILED = "Pending", "Succeeded", "Failed"
REQUEUE_REASONS = ("Preempted", "NodeFailures")  # evictions after which Kueue's integrations mark the workload requeued


def queue_name(obj: Mapping) -> str | None:
    """The LocalQueue the job names, if any: such a job runs only once Kueue admits it."""
    return ((obj.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or None


def workload_name(job: Job) -> str:
    return f"{job.name}-wtj"


@dataclass(frozen=True)
class Placement:
    """Where Kueue's admission puts a role's pods: its flavors' node labels and tolerations."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple = ()


@dataclass(frozen=True)
class Admission:
    """Where the job stands in its queue.

    admitted: Kueue admitted the Workload and has not evicted it: the job may run, on
    `placements` (role -> Placement);
    evicted: Kueue took the admission back: the job's pods must go before the quota is given
    back (`quota_held`: the Workload still holds it);
    message: why the job waits, in Kueue's words (a LocalQueue that does not exist, the quota
    that is short), or where it was admitted."""

    admitted: bool
    message: str
    evicted: bool = False
    quota_held: bool = False
    cluster_queue: str = ""
    placements: Mapping[str, Placement] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        return not self.admitted


def condition_of(workload: Mapping, kind: str) -> Mapping:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def is_true(workload: Mapping, kind: str) -> bool:
    return condition_of(workload, kind).get("status") == "True"


def pod_sets(job: Job, templates: Mapping[str, Mapping]) -> list[dict]:
    """One pod set per role the operator runs pods of (`templates`: role -> its pod template), in
    the roles' order, each with the role's pod count (inference: maxReplicas where set, the most a
    scaled job runs)."""
    return [{"name": role, "count": job.layout.replicas(role), "template": templates[role]}
            for role in ROLES if role in templates]


def workload(job: Job, queue: str, templates: Mapping[str, Mapping], priority: tuple[str, int] | None = None) -> dict:
    """The job's Workload. `priority`: the WorkloadPriorityClass the job's label names, with its
    value, for Kueue to order and preempt by. Owned by the job (the handler adopts it)."""
    sets = pod_sets(job, templates)
    spec: dict = {"queueName": queue, "podSets": sets, "active": not job.suspended}
    if priority:
        spec["priorityClassRef"] = {"group": GROUP, "kind": PRIORITY_CLASS, "name": priority[0]}
        spec["priority"] = priority[1]
    return {
        "apiVersion": API_VERSION,
        "kind": WORKLOAD,
        "metadata": {"name": workload_name(job), "namespace": job.namespace, "labels": job.labels(),
                     "annotations": {TEMPLATE_HASH: pod_sets_hash(sets)}},
        "spec": spec,
    }


def pod_sets_hash(sets: list[dict]) -> str:
    return hashlib.sha256(json.dumps(sets, sort_keys=True).encode()).hexdigest()[:16]


def stale(stored: Mapping, wanted: Mapping) -> bool:
    """Whether a stored Workload's pod sets are not the job's any more (the spec changed before
    it ran) while Kueue holds no quota for it: then it is made again. Kueue never sees the pod
    sets of a Workload with quota change."""
    stored_hash = (stored["metadata"].get("annotations") or {}).get(TEMPLATE_HASH)
    return stored_hash != wanted["metadata"]["annotations"][TEMPLATE_HASH] and not is_true(stored, QUOTA_RESERVED)


def admission(stored: Mapping | None, flavors: Mapping[str, Mapping]) -> Admission:
    """Where the job stands, from its Workload as stored (None: not yet written) and the specs of
    the ResourceFlavors the admission names (flavor name -> spec)."""
    if stored is None:
        return Admission(False, "its Kueue Workload is being created")
    status = stored.get("status") or {}
    if is_true(stored, FINISHED):
        return Admission(False, "its Kueue Workload is finished")
    evicted = condition_of(stored, EVICTED)
    if evicted.get("status") == "True":
        return Admission(False, f"evicted by Kueue ({evicted.get('reason')}): {evicted.get('message', '')}",
                         evicted=True, quota_held=is_true(stored, QUOTA_RESERVED))
    granted = status.get("admission")
    if not is_true(stored, ADMITTED) or not granted:
        reserved = condition_of(stored, QUOTA_RESERVED)
        why = reserved.get("message") or "waiting for Kueue to reserve quota (is Kueue running?)"
        return Admission(False, why)
    placements = {}
    for assignment in granted.get("podSetAssignments") or []:
        selector: dict = {}
        tolerations: list = []
        for name in dict.fromkeys((assignment.get("flavors") or {}).values()):
            spec = flavors.get(name) or {}
            selector.update(spec.get("nodeLabels") or {})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        placements[assignment["name"]] = Placement(selector, tuple(tolerations))
    queue = granted.get("clusterQueue", "")
    return Admission(True, f"admitted by Kueue to ClusterQueue {queue}", cluster_queue=queue, placements=placements)


def flavor_names(stored: Mapping | None) -> list[str]:
    granted = ((stored or {}).get("status") or {}).get("admission") or {}
    return list(dict.fromkeys(f for a in granted.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()))


def _conditions_with(stored: Mapping, *new: Mapping, at: str) -> list[dict]:
    """The Workload's conditions with `new` set (by type), the transition time kept where the
    status did not change."""
    conditions = {c["type"]: dict(c) for c in (stored.get("status") or {}).get("conditions") or []}
    for c in new:
        before = conditions.get(c["type"])
        kept = before and before.get("status") == c["status"] and before.get("lastTransitionTime")
        conditions[c["type"]] = {**c, "lastTransitionTime": before["lastTransitionTime"] if kept else at,
                                 "observedGeneration": stored["metadata"].get("generation", 1)}
    return list(conditions.values())


def quota_returned(stored: Mapping, at: str) -> dict:
    """The status patch that gives an evicted Workload's quota back once the job's pods are gone:
    no admission, QuotaReserved and Admitted false, and Requeued where Kueue preempted it."""
    evicted = condition_of(stored, EVICTED)
    reason, message = evicted.get("reason", "Evicted"), evicted.get("message") or "evicted"
    new = [{"type": QUOTA_RESERVED, "status": "False", "reason": KUEUE_PENDING, "message": message},
           {"type": ADMITTED, "status": "False", "reason": "NoReservation", "message": "The workload has no reservation"},
           {"type": REQUEUED, "status": "True" if reason in REQUEUE_REASONS else "False", "reason": reason,
            "message": message}]
    return {"admission": None, "conditions": _conditions_with(stored, *new, at=at)}


def finished(stored: Mapping, succeeded: bool, message: str, at: str) -> dict:
    """The status patch that finishes the Workload of a finished job, which frees its quota."""
    new = {"type": FINISHED, "status": "True", "reason": KUEUE_SUCCEEDED if succeeded else KUEUE_FAILED,
           "message": message or ("the job succeeded" if succeeded else "the job failed")}
    return {"conditions": _conditions_with(stored, new, at=at)}


def priority_of(kube: Kube, obj: Mapping) -> tuple[str, int] | None:
    """The WorkloadPriorityClass the job's label names, with its value. One that does not exist is
    the user's to fix: a ValueError that says so (the job waits, its condition saying why)."""
    name = ((obj.get("metadata") or {}).get("labels") or {}).get(PRIORITY_LABEL)
    if not name:
        return None
    found = kube.get(API_VERSION, PRIORITY_CLASS, None, name)
    if found is None:
        raise ValueError(f"WorkloadPriorityClass {name} (label {PRIORITY_LABEL}) does not exist: create it, "
                         f"or change the label")
    return name, int(found.get("value") or 0)


def read(kube: Kube, job: Job, obj: Mapping) -> Admission | None:
    """Where a queued job stands (None: it names no queue), from its Workload as stored; reads
    the assigned flavors only when admitted. Writes nothing."""
    if not queue_name(obj):
        return None
    return admission_of(kube, kube.get(API_VERSION, WORKLOAD, job.namespace, workload_name(job)))


def admission_of(kube: Kube, stored: Mapping | None) -> Admission:
    """Where the job of a Workload as stored stands, with the flavors its admission names."""
    flavors = {}
    if stored is not None and is_true(stored, ADMITTED):
        for name in flavor_names(stored):
            flavor = kube.get(API_VERSION, FLAVOR, None, name)
            flavors[name] = (flavor or {}).get("spec") or {}
    return admission(stored, flavors)


def gate(kube: Kube, job: Job, obj: Mapping, templates: Mapping[str, Mapping], adopt, at: str) -> Admission | None:
    """The queued job's Workload written (made again while Kueue holds no quota for pod sets that
    changed; only `active`, which follows spec.suspend, once it holds some), the quota of an
    evicted one given back once the job's pods are gone, and a finished job's Workload finished.
    `adopt` makes the job own the Workload. Returns where the job stands (None: no queue)."""
    queue = queue_name(obj)
    if not queue:
        return None
    try:
        priority = priority_of(kube, obj)
    except ValueError as e:
        return Admission(False, str(e))
    wanted = workload(job, queue, templates, priority)
    adopt(wanted)
    stored = kube.get(API_VERSION, WORKLOAD, job.namespace, wanted["metadata"]["name"])
    if stored is not None and stale(stored, wanted):
        kube.delete(API_VERSION, WORKLOAD, job.namespace, wanted["metadata"]["name"])
        stored = None
    if stored is None:
        try:
            kube.apply(wanted)
        except ApiError as e:
            if e.status != 409:  # 409: the old one is still being deleted; its deletion calls again
                raise
    elif bool((stored.get("spec") or {}).get("active", True)) != wanted["spec"]["active"]:
        kube.request("PATCH", path(API_VERSION, WORKLOAD, job.namespace, wanted["metadata"]["name"]),
                     {"spec": {"active": wanted["spec"]["active"]}}, content_type="application/merge-patch+json")
    stored = kube.get(API_VERSION, WORKLOAD, job.namespace, wanted["metadata"]["name"])
    completion = ((obj.get("status") or {}).get("completion") or {})
    if stored is not None and states.ended(completion.get("state")) and not is_true(stored, FINISHED):
        kube.patch_status(stored, finished(stored, completion["state"] == states.SUCCEEDED, completion.get("message", ""), at))
        return Admission(False, "the job finished; its Kueue Workload is finished")
    now = admission_of(kube, stored)
    if now.evicted and now.quota_held and not kube.list("v1", "Pod", job.namespace, f"{LABEL_JOB}={job.name}"):
        kube.patch_status(stored, quota_returned(stored, at))
    return now
