"""Writing a job's status: the one place that does it, from every handler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import kopf

from weightsync.job import ANNOTATION_NETWORK_MODE, ANNOTATION_NETWORK_REASON, ROLES, Job
from weightsync.job.join import external_roles
from weightsync_operator import queueing, status
from weightsync_operator.kube import ApiError, Kube

# Attempts when the job changes between reading and writing its status (the controller pod
# writes status.transfer at the same time): the optimistic-concurrency retry of every controller.
CONFLICT_ATTEMPTS = 5


@dataclass(frozen=True)
class Indexes:
    """The operator's indexes (handlers/children.py), as every handler receives them."""

    statefulsets: Mapping  # (namespace, job) -> [{"role", "ready", "created"}]
    pods: Mapping  # (namespace, job) -> [("pod <name>", reason, message)] of stuck pods
    failed_creates: Mapping  # (namespace, job) -> [(StatefulSet name, role, message)]
    restarts: Mapping  # (namespace, job) -> [(role, container restarts)] of the pods that restarted

    @classmethod
    def of(cls, handler_kwargs: Mapping) -> "Indexes":
        return cls(handler_kwargs["statefulsets_by_job"], handler_kwargs["pods_by_job"],
                   handler_kwargs["failed_creates_by_job"], handler_kwargs["restarts_by_job"])

    def observed(self, namespace: str, name: str, running: Mapping[str, int]):
        """What the indexes know about one job: its StatefulSets by role; its problems: stuck
        pods, and StatefulSets that lack pods because creating them failed (admission refused
        them, a quota is full); and its pods' container restarts by role."""
        key = (namespace, name)
        statefulsets = {s["role"]: s for s in self.statefulsets.get(key, [])}
        problems = [tuple(p) for p in self.pods.get(key, [])]
        for sts, role, message in self.failed_creates.get(key, []):
            created = statefulsets.get(role, {}).get("created")
            if created is not None and created < running[role]:
                problems.append((f"StatefulSet {sts}", "FailedCreate", message))
        restarts: dict[str, int] = {}
        for role, count in self.restarts.get(key, []):
            restarts[role] = restarts.get(role, 0) + count
        return statefulsets, problems, restarts


def network_of(job: Mapping) -> dict | None:
    """The job's network as the operator recorded it in the job's annotations (the status shows
    it; a status written by anyone else is put back)."""
    annotations = job["metadata"].get("annotations") or {}
    mode = annotations.get(ANNOTATION_NETWORK_MODE)
    return {"mode": mode, "reason": annotations.get(ANNOTATION_NETWORK_REASON, "")} if mode else None


def report(kube: Kube, namespace: str, name: str, indexes: Indexes, *,
           set_conditions: Iterable[Mapping] = (), observed_generation: int | None = None) -> dict | None:
    """Recompute the operator-owned status of a job and write what changed, with the Events the
    change deserves. Writes nothing when nothing changed. Returns the status as written."""
    set_conditions = list(set_conditions)
    for _ in range(CONFLICT_ATTEMPTS):
        job = kube.get_job(namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return None
        current = job.get("status") or {}
        loaded = Job(name, namespace, job["spec"])  # the spec as stored: defaulted
        running = {role: loaded.running_pods(role) for role in ROLES}
        statefulsets, problems, restarts = indexes.observed(namespace, name, running)
        queued = queueing.read(kube, loaded, job)
        new = status.compute(current, loaded.layout, statefulsets, problems, set_conditions, pod_restarts=restarts,
                             external=external_roles(loaded), suspended=loaded.suspended, queued=queued,
                             running=running)
        if (loaded.suspended or (queued and queued.held)) and current.get("controller"):
            # its controller pod is gone with the others: the one a resume (or an admission)
            # starts begins the job anew, not as a controller started again in the middle of it
            new["controller"] = None
        network = network_of(job)
        if network and current.get("network") != network:
            new["network"] = network
        if observed_generation is not None:
            new["observedGeneration"] = observed_generation
        patch = status.changes(current, new)
        if not patch:
            return current
        try:
            kube.patch_job_status(namespace, name, patch, job["metadata"]["resourceVersion"])
        except ApiError as e:
            if e.status == 409:
                continue
            if e.status == 404:  # deleted since it was read
                return None
            raise
        events = status.events(current, {**current, **patch})
        # Not into a namespace being deleted: no Event can be created there.
        if events and not kube.namespace_terminating(namespace):
            for kind, reason, message in events:
                kopf.event(job, type=kind, reason=reason, message=message)
        return {**current, **patch}
    raise kopf.TemporaryError(f"the status of {namespace}/{name} kept changing while it was being written", delay=1)
