"""The job's StatefulSets and pods, watched by label: their readiness and their problems refresh
the job's status."""

from __future__ import annotations

import kopf

from weightsync.contract import LABEL_JOB, LABEL_ROLE, ROLES
from weightsync_operator.report import report
from weightsync_operator.status import pod_problem

OWNED = {LABEL_JOB: kopf.PRESENT, LABEL_ROLE: kopf.PRESENT}


def _ours(labels, **_) -> bool:
    return labels.get(LABEL_ROLE) in ROLES


@kopf.index("apps", "v1", "statefulsets", labels=OWNED, when=_ours)
def statefulsets_by_job(namespace, labels, status, **_):
    """Each StatefulSet's ready pods: the desired counts come from the job's own layout."""
    return {(namespace, labels[LABEL_JOB]): {"role": labels[LABEL_ROLE], "ready": status.get("readyReplicas", 0)}}


@kopf.index("", "v1", "pods", labels=OWNED, when=_ours)
def pods_by_job(namespace, name, labels, status, **_):
    """Only the job's pods that are stuck for a reason someone must fix ({} drops a pod that
    recovered; None would keep its old entry)."""
    problem = pod_problem(status)
    return {(namespace, labels[LABEL_JOB]): (name, *problem)} if problem else {}


@kopf.on.event("apps", "v1", "statefulsets", labels=OWNED, when=_ours)
def statefulset_changed(namespace, labels, memo: kopf.Memo, statefulsets_by_job: kopf.Index,
                        pods_by_job: kopf.Index, **_):
    report(memo.kube, namespace, labels[LABEL_JOB], statefulsets_by_job, pods_by_job)


@kopf.on.event("", "v1", "pods", labels=OWNED, when=lambda status, **_: pod_problem(status) is not None)
def pod_stuck(namespace, labels, memo: kopf.Memo, statefulsets_by_job: kopf.Index,
              pods_by_job: kopf.Index, **_):
    # A pod that recovers changes its StatefulSet's readiness, which refreshes the status too.
    report(memo.kube, namespace, labels[LABEL_JOB], statefulsets_by_job, pods_by_job)
