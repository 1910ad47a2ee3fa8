"""Operator-wide settings and the shared API connection."""

import logging

import kopf

from weightsync import contract
from weightsync_operator.kube import Kube, load_client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    # The CRD's status has a strict schema (kopf's own status fields would be pruned): kopf keeps
    # its handler progress and last-handled spec in annotations of the job instead.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=contract.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=contract.GROUP, key="last-handled-configuration")
    # Events say what users must know (network chosen, a problem, a phase): the handlers post
    # them when a condition changes. kopf would post one more at every retry of a failing handler.
    settings.posting.level = logging.CRITICAL
    # Handlers wait on the API server, not on the CPU: many jobs are handled at once.
    settings.execution.max_workers = 20
    memo.kube = Kube(load_client())
