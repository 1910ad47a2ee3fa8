"""Kueue's side of a job that names a queue (queueing.py): its Workload admitted, evicted or
deleted, and the last pod of an evicted job gone (its quota can be given back), reconcile the job."""

from __future__ import annotations

import kopf

from weightsync.job import LABEL_JOB
from weightsync_operator import queueing
from weightsync_operator.reconcile import OWNED, load, of_a_role, owned_by_job, queued_job, reconcile_job
from weightsync_operator.report import Indexes


@kopf.on.event(queueing.GROUP, queueing.VERSION, queueing.PLURAL, labels={LABEL_JOB: kopf.PRESENT}, when=owned_by_job)
def workload_changed(namespace, labels, memo: kopf.Memo, logger, **kwargs):
    """Admitted (the pods start on the assigned flavors), evicted (they go), deleted (written again,
    and the job waits for a new admission), finished: the job's handler does each."""
    job = queued_job(memo, namespace, labels[LABEL_JOB])
    if job is not None:
        reconcile_job(memo, job, logger, Indexes.of(kwargs))


@kopf.on.event("", "v1", "pods", labels=OWNED, when=lambda **kw: kw.get("type") == "DELETED" and of_a_role(**kw))
def pod_gone(namespace, labels, memo: kopf.Memo, logger, **kwargs):
    """An evicted job's quota goes back to Kueue only when its last pod is gone."""
    job = queued_job(memo, namespace, labels[LABEL_JOB])
    if job is None:
        return
    queued = queueing.read(memo.kube, load(job), job)
    if queued is not None and queued.evicted and queued.quota_held:
        reconcile_job(memo, job, logger, Indexes.of(kwargs))
