"""A WeightTransferJob's reconcile: its children brought to what the job wants (created, patched,
scaled to zero when its controller reports completion, held while its Kueue queue has not admitted
it), one reconcile of a job at a time. The kopf handlers in handlers/ call it when the job, one of
its children or its Kueue Workload changes; a child deleted or changed by anyone but the operator
is put back by it. Children are owned by the job, so deleting it removes them all (no finalizer)."""

from __future__ import annotations

import base64
import copy
import functools
import threading
from typing import Callable, Mapping

import kopf

from weightsync.job import (
    ANNOTATION_TOKEN_SHA256,
    ANNOTATION_WORKER_IMAGE,
    API_VERSION,
    KIND,
    LABEL_JOB,
    LABEL_ROLE,
    ROLES,
    STORE_PORT,
    TOKEN_KEY,
    Job,
    SpecError,
    join,
    load_job,
    reasons,
    states,
)
from weightsync.job.states import Condition
from weightsync_operator import queueing, render, tokens
from weightsync_operator.decisions import TokenLost, decide, recorded, recorded_mode
from weightsync_operator.kube import ApiError, Kube, matches
from weightsync_operator.metrics import METRICS
from weightsync_operator.report import Indexes, report
from weightsync_operator.status import condition, now

# What a job owns: its children carry its name and their role in labels, and the job controls them.
OWNED = {LABEL_JOB: kopf.PRESENT, LABEL_ROLE: kopf.PRESENT}


def of_a_role(labels, **_) -> bool:
    return labels.get(LABEL_ROLE) in ROLES


def owned_by_job(body, labels, **_) -> bool:
    """Controlled by the job its label names (not merely labelled like one)."""
    return any(ref.get("kind") == "WeightTransferJob" and ref.get("controller") and ref.get("name") == labels.get(LABEL_JOB)
               for ref in body.get("metadata", {}).get("ownerReferences") or [])


class JobLocks:
    """One lock per job, so that its reconciles run one at a time. The job's own handlers and the
    handlers of its Workload and children run on threads of their own: two at once could each
    read where the job stands, one just before Kueue admitted it, and the one that read first
    could write last (it scaled a just-admitted job's StatefulSets back to zero, deleting its first
    pods as they started)."""

    def __init__(self):
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def of(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: its lock goes too (a reconcile holding it still finishes)."""
        with self._guard:
            self._locks.pop((namespace, name), None)


def reconcile_job(memo: kopf.Memo, obj: Mapping, logger, indexes: Indexes, repairing: bool = False):
    """Bring the job's children to what it wants; `repairing`: because a child was deleted or
    changed by someone else (what is patched then is a repair too). One reconcile of a job at a
    time, each from the job as it is once its turn came (JobLocks): the last to write read last."""
    namespace, name, uid = obj["metadata"]["namespace"], obj["metadata"]["name"], obj["metadata"].get("uid")
    with memo.job_locks.of(namespace, name):
        fresh = memo.kube.get_job(namespace, name)
        if fresh is None:
            memo.job_locks.forget(namespace, name)
            return  # deleted
        if fresh["metadata"]["uid"] != uid:
            return  # deleted and made again: the new job's own handlers reconcile it
        reconcile_read(memo, fresh, logger, indexes, repairing)


def reconcile_read(memo: kopf.Memo, obj: Mapping, logger, indexes: Indexes, repairing: bool = False):
    """One reconcile of the job as `obj` shows it (reconcile_job reads it afresh, in its turn)."""
    kube: Kube = memo.kube
    write = functools.partial(report, kube, obj["metadata"]["namespace"], obj["metadata"]["name"], indexes)
    METRICS.reconciles.inc()
    try:
        ensure_children(kube, memo.token_key, obj, write, logger, repairing)
    except (kopf.TemporaryError, kopf.PermanentError):
        METRICS.reconcile_errors.inc()
        raise
    except ApiError as e:
        if e.namespace_terminating:
            # Nothing may be created there any more, and the job goes with its namespace: no
            # condition, no Event (it could not be posted), no retry.
            logger.info(f"namespace {obj['metadata']['namespace']} is being deleted: the job's children are left as they are")
            return
        METRICS.reconcile_errors.inc()
        raise kopf.TemporaryError(str(e), delay=10) from None
    except Exception as e:
        # Not a refusal the operator knows: still a condition and an Event for the user (once,
        # not at every retry), and a retry later.
        message = f"{type(e).__name__}: {e}"
        METRICS.reconcile_errors.inc()
        write(set_conditions=[condition(Condition.CHILDREN_CREATED, False, reasons.OPERATOR_ERROR, message)])
        raise kopf.TemporaryError(message, delay=30) from e


def load(obj: Mapping) -> Job:
    meta = obj["metadata"]
    return load_job({"apiVersion": API_VERSION, "kind": KIND,
                              "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                              "spec": copy.deepcopy(dict(obj["spec"]))})


def standing(job: Job, obj: Mapping, queued: queueing.Admission | None) -> dict:
    """Where the job stands, as rendering needs it: stopped (its controller reported completion,
    it is suspended, or its Kueue queue has not admitted it), running, and where an admission
    puts each role's pods."""
    job_status = obj.get("status") or {}
    finished = states.ended((job_status.get("completion") or {}).get("state"))
    stopped = finished or job.suspended or (queued is not None and queued.held)
    return {"stopped": stopped, "running": job_status.get("phase") == states.RUNNING and not stopped,
            "placements": queued.placements if queued else {}}


def desired(job: Job, obj: Mapping, mode: str, token: str, image: str,
            queued: queueing.Admission | None) -> list[dict]:
    """Every child as the job wants it now, owned by the job."""
    manifests = render.children(job, mode, token, image=image, **standing(job, obj, queued))
    kopf.adopt(manifests, owner=obj)
    return manifests


def ensure_children(kube: Kube, key: bytes, obj: Mapping, write: Callable, logger, repairing: bool = False):
    namespace = obj["metadata"]["namespace"]
    try:
        job = load(obj)
    except SpecError as e:
        write(set_conditions=[condition(Condition.CHILDREN_CREATED, False, reasons.INVALID_SPEC, str(e))])
        raise kopf.PermanentError(str(e)) from None

    try:
        decisions = decide(kube, key, job, obj, write)
    except TokenLost as e:
        write(set_conditions=[condition(Condition.CHILDREN_CREATED, False, reasons.TOKEN_LOST, str(e))])
        raise kopf.PermanentError(str(e)) from None
    missing = missing_pull_secrets(kube, job)
    queued = admit(kube, job, obj, decisions, write)

    manifests = desired(job, obj, decisions.mode, decisions.token, decisions.image, queued)
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
        write(set_conditions=[condition(Condition.CHILDREN_CREATED, False, reasons.IMAGE_PULL_SECRET_MISSING, message)])
        raise kopf.TemporaryError(message, delay=15)

    before = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == Condition.CHILDREN_CREATED), {})
    was_created = before.get("status") == "True"
    # Put back: a child created again (it had been deleted) or one a child's change made the
    # operator patch. A spec change, completion or the start of running patch children too.
    restored = [w for w, o in changed.items() if o == "created" or repairing] if was_created else []
    conditions = []
    METRICS.children_repaired.inc(len(restored))
    if restored:
        message = "put back " + ", ".join(
            f"{w} (it had been {'deleted' if changed[w] == 'created' else 'changed'})" for w in restored)
        if any(w.startswith("Secret ") for w in restored):
            message += "; the Secret holds the job's own token, as before"
        conditions.append(condition(Condition.CHILDREN_CREATED, True, reasons.REPAIRED, message))
        kopf.event(obj, type="Warning", reason=reasons.REPAIRED, message=message)
    elif changed or not was_created:
        conditions.append(condition(Condition.CHILDREN_CREATED, True, reasons.CREATED, created_message(job, manifests)))
    write(set_conditions=conditions, observed_generation=obj["metadata"].get("generation"))


def admit(kube: Kube, job: Job, obj: Mapping, decisions, write) -> queueing.Admission | None:
    """A job that names a Kueue queue: its Workload written, and where it stands (queueing.py).
    A cluster without Kueue leaves the job waiting, its Admitted condition saying so."""
    if not queueing.queue_name(obj):
        return None
    templates = {r: render.pod_template(job, r, decisions.mode, decisions.image)
                 for r in ROLES if r not in join.external_roles(job)}
    try:
        return queueing.gate(kube, job, obj, templates, lambda m: kopf.adopt(m, owner=obj), now())
    except ApiError as e:
        if e.status != 404:
            raise
        message = (f"the job names the Kueue queue {queueing.queue_name(obj)} (label {queueing.QUEUE_LABEL}), but "
                   f"the API server serves no {queueing.API_VERSION} Workloads: install Kueue, or remove the label")
        write(set_conditions=[condition(Condition.ADMITTED, False, reasons.QUEUED, message)])
        raise kopf.TemporaryError(message, delay=30) from None


def created_message(job: Job, manifests: list[dict]) -> str:
    """What ChildrenCreated says once every child is there: the kinds, the StatefulSets with their
    pods, and the roles whose processes the user starts (which have none)."""
    sets = [m for m in manifests if m["kind"] == "StatefulSet"]
    total = desired_replicas(manifests)
    pods = "scaled to zero" if total == 0 else f"{total} pods"
    secrets = "Secrets (token, join)" if any(m["metadata"]["name"] == job.join_secret_name for m in manifests) else "Secret"
    message = (f"Service, {secrets}, ConfigMap, ServiceAccount, Role, RoleBinding and "
               f"{len(sets)} StatefulSets ({pods}) match the job")
    external = join.external_roles(job)
    if external:
        message += (f"; no pods for the {' and '.join(external)} ranks (external: your own processes join "
                    f"with envFrom Secret {job.join_secret_name})")
    return message


def drifted(kube: Kube, obj: Mapping, child: Mapping) -> bool:
    """Whether a stored child differs from what its job wants (the job's decisions recorded)."""
    done = recorded(obj)
    try:
        job = load(obj)
    except SpecError:
        return False  # the job's own handler says why
    if child["kind"] == "Secret" and child["metadata"]["name"] == job.join_secret_name:
        return join_secret_drifted(job, child, done[ANNOTATION_TOKEN_SHA256])
    if child["kind"] == "Secret":
        value = (child.get("data") or {}).get(TOKEN_KEY) or ""
        return tokens.fingerprint(base64.b64decode(value).decode(errors="replace")) != done[ANNOTATION_TOKEN_SHA256]
    mode, image = recorded_mode(job, done), done[ANNOTATION_WORKER_IMAGE]
    if child["kind"] == "StatefulSet":
        # The one StatefulSet (they change often; the rest rarely): rendered alone.
        role = (child["metadata"].get("labels") or {}).get(LABEL_ROLE)
        if role not in ROLES or role in join.external_roles(job):
            return False  # not a role's, or one the job runs no pods of (the job's handler renders none)
        queued = queueing.read(kube, job, obj)
        wanted = [render.statefulset(job, role, mode, image=image, **placed(standing(job, obj, queued), role))]
        kopf.adopt(wanted, owner=obj)
        # Its update strategy changes when the job starts running: the job's handler does that.
        del wanted[0]["spec"]["updateStrategy"]
    else:
        wanted = desired(job, obj, mode, "", image, None)  # the StatefulSets, the one kind Kueue places, are above
    for want in wanted:
        if (want["kind"], want["metadata"]["name"]) == (child["kind"], child["metadata"]["name"]):
            return not matches(want, child)
    return False


def placed(where: Mapping, role: str) -> dict:
    """`standing` as one role's StatefulSet takes it."""
    return {"stopped": where["stopped"], "running": where["running"], "placement": where["placements"].get(role)}


def join_secret_drifted(job: Job, child: Mapping, token_sha256: str) -> bool:
    """Whether a stored join Secret differs from what the job wants: other keys, another
    controller address or job id, or a token that is not the job's (known by its fingerprint:
    the handler of a child's change holds no token)."""
    if not join.external_roles(job):
        return False  # left from a spec that had an external role: nothing to put back
    stored = {k: base64.b64decode(v).decode(errors="replace") for k, v in (child.get("data") or {}).items()}
    wanted = join.join_env(job, job.controller_host, STORE_PORT, b"")
    token = stored.pop(join.JoinEnv.TOKEN, "")
    del wanted[join.JoinEnv.TOKEN]
    return stored != wanted or tokens.fingerprint(token) != token_sha256 or child.get("type", "Opaque") != "Opaque"


def desired_replicas(manifests: list[dict]) -> int:
    return sum(m["spec"]["replicas"] for m in manifests if m["kind"] == "StatefulSet")


def refused(write, what: str, e: ApiError):
    """A child the API server would not take: a condition and an Event, never a crash."""
    if e.namespace_terminating:
        raise e
    if e.status in (400, 422):
        message = f"the API server refused {what}: {e.message}"
        write(set_conditions=[condition(Condition.CHILDREN_CREATED, False, reasons.CHILD_REFUSED, message)])
        raise kopf.PermanentError(message)
    if e.status == 403:
        message = (f"the operator may not write {what}: {e.message} (is this namespace one the operator "
                   f"watches? The chart grants it rights only in its watchNamespaces)")
        write(set_conditions=[condition(Condition.CHILDREN_CREATED, False, reasons.FORBIDDEN, message)])
        raise kopf.TemporaryError(message, delay=60)
    raise kopf.TemporaryError(str(e), delay=10)


def missing_pull_secrets(kube: Kube, job: Job) -> list[str]:
    return [n for n in job.image_pull_secrets if kube.get("v1", "Secret", job.namespace, n) is None]


def put_back(memo: kopf.Memo, event, body, labels, logger, indexes: Indexes):
    """A child was deleted, or changed so that it is not what its job wants: reconcile the job
    (which creates or patches it, and says so in a condition and an Event)."""
    if event not in ("MODIFIED", "DELETED") or not owned_by_job(body, labels):
        return  # listed at start-up (resuming each job compares every child), or just created
    namespace = body["metadata"]["namespace"]
    job = memo.kube.get_job(namespace, labels[LABEL_JOB])
    if job is None or job["metadata"].get("deletionTimestamp") or recorded(job) is None:
        return  # gone, going, or its first pass (which creates every child) is under way
    what = f"{body['kind']} {body['metadata']['name']}"
    if event == "DELETED":
        cause = f"{what} was deleted"
    elif drifted(memo.kube, job, dict(body)):
        cause = f"{what} was changed"
    else:
        return
    logger.info(f"{cause}: putting it back")
    reconcile_job(memo, job, logger, indexes, repairing=True)


def queued_job(memo: kopf.Memo, namespace: str, name: str) -> dict | None:
    """The job `name` when it names a Kueue queue and its first pass is done, else None."""
    job = memo.kube.get_job(namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp") or recorded(job) is None:
        return None  # gone, going, or its first pass (which writes the Workload) is under way
    return job if queueing.queue_name(job) else None
