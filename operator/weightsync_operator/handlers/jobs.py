"""kopf's registrations for a WeightTransferJob itself: it is reconciled (reconcile.py) when it
appears, when the operator restarts, when its spec changes, when it starts running and when its
controller reports completion; what its controller pod reports (network, rejoins, receivers)
refreshes its status or becomes Events; every job seen is counted for the metrics."""

from __future__ import annotations

import kopf

from weightsync.job import GROUP, PLURAL, VERSION, states
from weightsync_operator.metrics import METRICS
from weightsync_operator.reconcile import reconcile_job
from weightsync_operator.report import Indexes, report
from weightsync_operator.status import receiver_events

JOBS = dict(group=GROUP, version=VERSION, plural=PLURAL)


@kopf.on.resume(**JOBS)
@kopf.on.create(**JOBS)
@kopf.on.update(**JOBS, field="spec", id="update")
@kopf.on.field(**JOBS, field="status.completion", id="completion")
@kopf.on.field(**JOBS, field="status.phase", new=states.RUNNING, id="running")  # pod templates stop rolling
def reconcile(body: kopf.Body, memo: kopf.Memo, logger, **kwargs):
    reconcile_job(memo, body, logger, Indexes.of(kwargs))


@kopf.on.event(**JOBS)
def job_seen(type, body: kopf.Body, **_):  # noqa: A002 - kopf's name
    """Every job as the API server shows it, for the operator's jobs-by-phase metric."""
    METRICS.job_seen(body.metadata.uid, (body.get("status") or {}).get("phase"), gone=type == "DELETED")


@kopf.on.field(**JOBS, field="status.network", id="network")
def network_written(body: kopf.Body, memo: kopf.Memo, **kwargs):
    """The status shows the network the operator recorded in the job's annotations: a status
    written by anyone else (the job's controller pod may write it) is put back."""
    report(memo.kube, body.metadata.namespace, body.metadata.name, Indexes.of(kwargs))


@kopf.on.field(**JOBS, field="status.rejoins", id="rejoins")
def rejoins_reported(body: kopf.Body, memo: kopf.Memo, **kwargs):
    """The job's controller pod counted ranks that rejoined: the counts go to status.replicas."""
    report(memo.kube, body.metadata.namespace, body.metadata.name, Indexes.of(kwargs))


@kopf.on.field(**JOBS, field="status.receivers", id="receivers")
def receivers_reported(body: kopf.Body, memo: kopf.Memo, old, new, **_):
    """The job's controller pod reported its inference ranks' states: Events for the moments that
    matter (every rank joined, a rank away, a rank back), posted here so that no pod of a job
    needs the right to post Events."""
    events = receiver_events(old, new)
    if events and not memo.kube.namespace_terminating(body.metadata.namespace):
        for kind, reason, message in events:
            kopf.event(body, type=kind, reason=reason, message=message)
