"""Operator-wide settings, the shared API connection and the job tokens' key; its metrics served
(metrics.py); serving only once the CRD is served, and a liveness probe that fails while it is not,
or once Kueue's Workloads are served when they were not at start (a restart then watches them)."""

import asyncio
import logging

import kopf

from weightsync.job import API_VERSION, GROUP, KIND, PLURAL
from weightsync_operator import queueing, tokens
from weightsync_operator.kube import ApiError, Kube, load_client
from weightsync_operator.metrics import METRICS, metrics_port
from weightsync_operator.reconcile import JobLocks

CRD_POLL_SECONDS = 2


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_):
    # The CRD's status has a strict schema (kopf's own status fields would be pruned): kopf keeps
    # its handler progress and last-handled spec in annotations of the job instead.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Events say what users must know (network chosen, a problem, a phase): the handlers post
    # them when a condition changes. kopf would post one more at every retry of a failing handler.
    settings.posting.level = logging.CRITICAL
    # Handlers wait on the API server, not on the CPU: many jobs are handled at once.
    settings.execution.max_workers = 20
    memo.kube = Kube(load_client(connections=settings.execution.max_workers))
    memo.token_key = await asyncio.to_thread(tokens.load_key, memo.kube)
    memo.compared_statefulsets = {}  # uid -> what was compared last (handlers/children.py)
    memo.pod_restarts = {}  # pod uid -> the container restarts last reported (handlers/children.py)
    memo.job_locks = JobLocks()  # one reconcile of a job at a time (reconcile.py)
    try:  # a port that is taken or wrong stops the operator, saying so, rather than run it unmeasured
        memo.metrics_server = METRICS.serve("0.0.0.0", metrics_port())
    except (OSError, ValueError) as e:
        raise kopf.PermanentError(str(e)) from None
    # kopf finds the resources it serves when it starts, before any handler runs: an operator
    # started before its CRD would serve nothing (a CRD that appears later is found only when
    # discovery has caught up by the time kopf looks). So it starts serving once the CRD is
    # served; until then its liveness endpoint does not answer.
    # kopf resolves the resources it watches when it starts: Kueue's Workloads only if Kueue's CRDs
    # are served by then (its log says once where they are not).
    memo.kueue_at_start = await asyncio.to_thread(served, memo.kube, queueing.API_VERSION, queueing.PLURAL)
    if not await asyncio.to_thread(served, memo.kube):
        logger.warning(f"waiting for the CustomResourceDefinition {PLURAL}.{GROUP}: "
                       f"nothing is served until the API server serves {API_VERSION} {KIND}")
        while not await asyncio.to_thread(served, memo.kube):
            await asyncio.sleep(CRD_POLL_SECONDS)
        logger.info(f"the API server serves {API_VERSION} {KIND}: starting")


@kopf.on.probe(id="served")
def crd_served(memo: kopf.Memo, **_):
    """Liveness: fails (HTTP 500) when the API server does not answer or no longer serves the
    jobs (their CRD was deleted), so that a restart waits for the CRD again; and when Kueue was
    installed after the operator started, so that a restart watches the Workloads of queued jobs."""
    try:
        ok = served(memo.kube)
        kueue_now = not memo.kueue_at_start and served(memo.kube, queueing.API_VERSION, queueing.PLURAL)
    except Exception as e:  # noqa: BLE001 - refused, or no connection: any failure fails the probe
        raise kopf.PermanentError(f"the API server does not answer: {e}") from None
    if not ok:
        raise kopf.PermanentError(f"the API server does not serve {API_VERSION} {KIND}")
    if kueue_now:
        raise kopf.PermanentError(f"the API server serves Kueue's {queueing.API_VERSION} Workloads, which it did not "
                                  "when the operator started: a restart watches them")
    return True


def served(kube: Kube, api_version: str = API_VERSION, plural: str = PLURAL) -> bool:
    """Whether API discovery lists the resource (the jobs' by default): it does once its CRD is
    Established."""
    try:
        listed = kube.request("GET", f"/apis/{api_version}")
    except ApiError as e:
        if e.status == 404:
            return False
        raise
    return any(r.get("name") == plural for r in (listed or {}).get("resources") or [])
