"""Writing a job's status: the one place that does it, from every handler."""

from __future__ import annotations

from typing import Iterable, Mapping

import kopf

from weightsync.contract import Layout
from weightsync_operator import status
from weightsync_operator.kube import ApiError, Kube

# Attempts when the job changes between reading and writing its status (the controller pod
# writes status.transfer at the same time): the optimistic-concurrency retry of every controller.
CONFLICT_ATTEMPTS = 5


def observed(statefulsets_by_job: Mapping, pods_by_job: Mapping, namespace: str, name: str):
    """What the operator's indexes know about one job's StatefulSets and stuck pods."""
    key = (namespace, name)
    statefulsets = {s["role"]: s for s in statefulsets_by_job.get(key, [])}
    problems = [tuple(p) for p in pods_by_job.get(key, [])]
    return statefulsets, problems


def report(kube: Kube, namespace: str, name: str, statefulsets_by_job: Mapping, pods_by_job: Mapping, *,
           set_conditions: Iterable[Mapping] = (), network: Mapping | None = None,
           observed_generation: int | None = None) -> dict | None:
    """Recompute the operator-owned status of a job and write what changed, with the Events the
    change deserves. Writes nothing when nothing changed. Returns the status as written."""
    set_conditions = list(set_conditions)
    for _ in range(CONFLICT_ATTEMPTS):
        job = kube.get_job(namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return None
        current = job.get("status") or {}
        statefulsets, problems = observed(statefulsets_by_job, pods_by_job, namespace, name)
        new = status.compute(current, Layout.from_spec(job["spec"]), statefulsets, problems, set_conditions)
        if network and not current.get("network"):
            new["network"] = dict(network)
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
        for type, reason, message in status.events(current, {**current, **patch}):
            kopf.event(job, type=type, reason=reason, message=message)
        return {**current, **patch}
    raise kopf.TemporaryError(f"the status of {namespace}/{name} kept changing while it was being written", delay=1)
