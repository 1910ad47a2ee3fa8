"""What the job owns, watched by label: the readiness, problems and restarts of its StatefulSets
and pods refresh the job's status; a child deleted or changed by anyone but the operator is put
back."""

from __future__ import annotations

import kopf

from weightsync.job import LABEL_JOB, LABEL_ROLE, ROLES
from weightsync_operator.reconcile import OWNED, of_a_role, owned_by_job, put_back
from weightsync_operator.report import Indexes, report
from weightsync_operator.status import pod_problem, restarts

# The children besides the StatefulSets: (group, version, plural).
OTHER_CHILDREN = [("", "v1", "services"), ("", "v1", "secrets"), ("", "v1", "configmaps"), ("", "v1", "serviceaccounts"),
                  ("rbac.authorization.k8s.io", "v1", "roles"), ("rbac.authorization.k8s.io", "v1", "rolebindings")]


@kopf.index("apps", "v1", "statefulsets", labels=OWNED, when=of_a_role)
def statefulsets_by_job(namespace, labels, status, **_):
    """Each StatefulSet's ready and existing pods: the desired counts come from the job's own layout."""
    return {(namespace, labels[LABEL_JOB]): {"role": labels[LABEL_ROLE], "ready": status.get("readyReplicas", 0),
                                             "created": status.get("replicas", 0)}}


@kopf.index("", "v1", "pods", labels=OWNED, when=of_a_role)
def pods_by_job(namespace, name, labels, status, **_):
    """Only the job's pods that are stuck for a reason someone must fix ({} drops a pod that
    recovered; None would keep its old entry)."""
    problem = pod_problem(status)
    return {(namespace, labels[LABEL_JOB]): (f"pod {name}", *problem)} if problem else {}


@kopf.index("", "v1", "pods", labels=OWNED, when=of_a_role)
def restarts_by_job(namespace, labels, status, **_):
    """The container restarts of the job's pods that restarted, with their role ({} drops a pod
    that has none, a new one with the same name included)."""
    count = restarts(status)
    return {(namespace, labels[LABEL_JOB]): (labels[LABEL_ROLE], count)} if count else {}


def statefulset_of_a_job(body) -> tuple[str, str] | None:
    """(job, role) of the StatefulSet an Event is about, if it is named like a job's."""
    involved = body.get("involvedObject") or {}
    if involved.get("kind") != "StatefulSet":
        return None
    name = involved.get("name") or ""
    return next(((name[:-len(r) - 1], r) for r in ROLES if name.endswith(f"-{r}") and len(name) > len(r) + 1), None)


def _failed_create(body, **_) -> bool:
    # Not a problem of the job's: its namespace is being deleted, and the job with it.
    terminating = "because it is being terminated" in (body.get("message") or "")
    return body.get("reason") == "FailedCreate" and not terminating and statefulset_of_a_job(body) is not None


@kopf.index("", "v1", "events", when=_failed_create)
def failed_creates_by_job(namespace, body, **_):
    """The StatefulSet controller's account of pods it could not create: admission refused them
    (Pod Security, a policy engine) or a quota is full. Stale ones are told apart by the
    StatefulSet's own count of pods (report.Indexes.observed)."""
    job, role = statefulset_of_a_job(body)
    return {(namespace, job): (body["involvedObject"]["name"], role, body.get("message") or "")}


@kopf.on.event("", "v1", "events", when=_failed_create)
def pods_not_created(namespace, body, memo: kopf.Memo, **kwargs):
    job, _ = statefulset_of_a_job(body)
    report(memo.kube, namespace, job, Indexes.of(kwargs))


@kopf.on.event("apps", "v1", "statefulsets", labels=OWNED, when=of_a_role)
def statefulset_changed(type, body, namespace, labels, uid, memo: kopf.Memo, logger, **kwargs):  # noqa: A002 - kopf's name
    indexes = Indexes.of(kwargs)
    report(memo.kube, namespace, labels[LABEL_JOB], indexes)
    # Most of a StatefulSet's changes are its status: compared with what the job wants only when
    # its spec (generation) or metadata changed since the last comparison.
    compared = memo.compared_statefulsets
    seen = (body["metadata"].get("generation"), repr(body["metadata"].get("labels")),
            repr(body["metadata"].get("ownerReferences")))
    if type == "DELETED":
        compared.pop(uid, None)
    elif compared.get(uid) == seen:
        return
    else:
        compared[uid] = seen
    put_back(memo, type, body, labels, logger, indexes)


@kopf.on.event("", "v1", "pods", labels=OWNED, when=lambda status, **_: pod_problem(status) is not None)
def pod_stuck(namespace, labels, memo: kopf.Memo, **kwargs):
    # A pod that recovers changes its StatefulSet's readiness, which refreshes the status too.
    report(memo.kube, namespace, labels[LABEL_JOB], Indexes.of(kwargs))


@kopf.on.event("", "v1", "pods", labels=OWNED, when=lambda status, **_: restarts(status) > 0)
def pod_restarted(type, namespace, labels, uid, status, memo: kopf.Memo, **kwargs):  # noqa: A002 - kopf's name
    """A container restarted: the role's restarts in the job's status. Most events of a pod that
    restarted once are about something else: only a new count is reported."""
    seen = memo.pod_restarts
    if type == "DELETED":
        seen.pop(uid, None)  # the StatefulSet's count of pods changes too, which reports the job
        return
    count = restarts(status)
    if seen.get(uid) == count:
        return
    seen[uid] = count
    report(memo.kube, namespace, labels[LABEL_JOB], Indexes.of(kwargs))


def child_changed(type, body, labels, memo: kopf.Memo, logger, **kwargs):  # noqa: A002 - kopf's name
    put_back(memo, type, body, labels, logger, Indexes.of(kwargs))


for _group, _version, _plural in OTHER_CHILDREN:
    kopf.on.event(_group, _version, _plural, labels={LABEL_JOB: kopf.PRESENT}, when=owned_by_job)(child_changed)
