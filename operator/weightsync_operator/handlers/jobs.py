"""A WeightTransferJob's lifecycle: its children created (or found right) when it appears, when
the operator restarts, when its spec changes, and scaled to zero when its controller reports
completion. Children are owned by the job, so deleting it removes them all (no finalizer)."""

from __future__ import annotations

import base64
import copy
import functools
import secrets

import kopf

from weightsync import contract
from weightsync_operator import network, render
from weightsync_operator.kube import ApiError, Kube
from weightsync_operator.report import report
from weightsync_operator.status import CHILDREN_CREATED, NETWORK_RESOLVED, condition

JOBS = dict(group=contract.GROUP, version=contract.VERSION, plural=contract.PLURAL)


@kopf.on.resume(**JOBS)
@kopf.on.create(**JOBS)
@kopf.on.update(**JOBS, id="update")
@kopf.on.field(**JOBS, field="status.completion", id="completion")
def reconcile(body: kopf.Body, memo: kopf.Memo, logger, statefulsets_by_job: kopf.Index,
              pods_by_job: kopf.Index, **_):
    kube: Kube = memo.kube
    write = functools.partial(report, kube, body.metadata.namespace, body.metadata.name,
                              statefulsets_by_job, pods_by_job)
    try:
        ensure_children(kube, body, write, logger)
    except (kopf.TemporaryError, kopf.PermanentError):
        raise
    except Exception as e:
        # Not a refusal the operator knows: still a condition and an Event for the user (once,
        # not at every retry), and a retry later.
        message = f"{type(e).__name__}: {e}"
        write(set_conditions=[condition(CHILDREN_CREATED, False, "OperatorError", message)])
        raise kopf.TemporaryError(message, delay=30) from e


def ensure_children(kube: Kube, body: kopf.Body, write, logger):
    namespace, name = body.metadata.namespace, body.metadata.name
    try:
        job = contract.load_job({"apiVersion": contract.API_VERSION, "kind": contract.KIND,
                                 "metadata": {"name": name, "namespace": namespace},
                                 "spec": copy.deepcopy(dict(body.spec))})
    except contract.SpecError as e:
        write(set_conditions=[condition(CHILDREN_CREATED, False, "InvalidSpec", str(e))])
        raise kopf.PermanentError(str(e)) from None

    finished = ((body.get("status") or {}).get("completion") or {}).get("state") in ("Succeeded", "Failed")
    try:
        mode = network_mode(kube, job, body, write)
        token = stored_token(kube, job) or secrets.token_urlsafe(32)
        missing = missing_pull_secrets(kube, job)
    except ApiError as e:
        raise kopf.TemporaryError(str(e), delay=10) from None

    manifests = render.children(job, mode, token, finished=finished)
    kopf.adopt(manifests, owner=body)
    if missing:
        # Pods that cannot pull would only crash-loop: everything but the pods is created now,
        # the StatefulSets once the secrets exist.
        manifests = [m for m in manifests if m["kind"] != "StatefulSet"]
    outcomes = {}
    for manifest in manifests:
        what = f"{manifest['kind']} {manifest['metadata']['name']}"
        try:
            outcomes[what] = kube.ensure(manifest)
        except ApiError as e:
            refused(write, what, e)

    changed = {w: o for w, o in outcomes.items() if o != "unchanged"}
    if changed:
        logger.info("children: " + ", ".join(f"{w} {o}" for w, o in changed.items()))
    if missing:
        message = (f"image pull secret(s) {', '.join(missing)} not found in namespace {namespace}: create them; "
                   f"the StatefulSets are created once they exist")
        write(set_conditions=[condition(CHILDREN_CREATED, False, "ImagePullSecretMissing", message)])
        raise kopf.TemporaryError(message, delay=15)
    message = (f"Service, Secret, ConfigMap, ServiceAccount, Role, RoleBinding and 3 StatefulSets "
               f"({'scaled to zero' if finished else f'{job.layout.pods} pods'}) match the job")
    write(set_conditions=[condition(CHILDREN_CREATED, True, "Created", message)],
          observed_generation=body.metadata.get("generation"))


def refused(write, what: str, e: ApiError):
    """A child the API server would not take: a condition and an Event, never a crash."""
    if e.status in (400, 422):
        message = f"the API server refused {what}: {e.message}"
        write(set_conditions=[condition(CHILDREN_CREATED, False, "ChildRefused", message)])
        raise kopf.PermanentError(message)
    if e.status == 403:
        message = f"the operator may not write {what}: {e.message}"
        write(set_conditions=[condition(CHILDREN_CREATED, False, "Forbidden", message)])
        raise kopf.TemporaryError(message, delay=60)
    raise kopf.TemporaryError(str(e), delay=10)


def network_mode(kube: Kube, job: contract.Job, body: kopf.Body, write) -> str:
    """The job's resolved network mode: read back from its status, where it is recorded once."""
    recorded = (body.get("status") or {}).get("network") or {}
    if not recorded.get("mode"):
        fresh = kube.get_job(job.namespace, job.name) or {}
        recorded = (fresh.get("status") or {}).get("network") or {}
    if recorded.get("mode"):
        return recorded["mode"]
    requested = job.spec["network"]["mode"]
    nodes = kube.list("v1", "Node") if requested == "auto" else []
    mode, reason = network.resolve(job.spec, nodes)
    why = "Requested" if requested != "auto" else ("RdmaNodeFound" if mode == "rdma" else "NoRdmaNode")
    write(network={"mode": mode, "reason": reason},
          set_conditions=[condition(NETWORK_RESOLVED, True, why, f"network mode {mode}: {reason}")])
    return mode


def stored_token(kube: Kube, job: contract.Job) -> str | None:
    """The job's token when its Secret exists already: a job keeps its token for its lifetime."""
    stored = kube.get("v1", "Secret", job.namespace, job.secret_name)
    value = ((stored or {}).get("data") or {}).get(contract.TOKEN_KEY)
    return base64.b64decode(value).decode() if value else None


def missing_pull_secrets(kube: Kube, job: contract.Job) -> list[str]:
    names = [s["name"] for s in job.spec.get("imagePullSecrets") or []]
    return [n for n in names if kube.get("v1", "Secret", job.namespace, n) is None]
