"""What the operator decides once per job, when it first handles it: the network mode (for
`auto`, from the nodes), the default worker image, and the token. Recorded in the job's
annotations, which the job's own controller pod cannot write (it may patch only the status);
later passes read them back and never decide again."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Mapping

import kopf

from weightsync.job import (
    ANNOTATION_NETWORK_MODE,
    ANNOTATION_NETWORK_REASON,
    ANNOTATION_TOKEN_SHA256,
    ANNOTATION_WORKER_IMAGE,
    TOKEN_KEY,
    Job,
    reasons,
)
from weightsync.job.states import Condition
from weightsync_operator import network, render, tokens
from weightsync_operator.kube import Kube
from weightsync_operator.status import condition

DECISIONS = (ANNOTATION_NETWORK_MODE, ANNOTATION_NETWORK_REASON,
             ANNOTATION_WORKER_IMAGE, ANNOTATION_TOKEN_SHA256)


@dataclass(frozen=True)
class Decisions:
    """What the operator decided when it first handled the job, recorded in the job's annotations."""

    mode: str
    reason: str
    image: str
    token: str


class TokenLost(Exception):
    """The job's Secret is gone and no token the operator can produce is the job's."""


def recorded(obj: Mapping) -> dict[str, str] | None:
    """The job's recorded decisions, None before the operator first handled it."""
    annotations = obj["metadata"].get("annotations") or {}
    if not all(annotations.get(k) for k in DECISIONS):
        return None
    return {k: annotations[k] for k in DECISIONS}


def recorded_mode(job: Job, decisions: Mapping[str, str]) -> str:
    """A job that names its mode gets that mode, whatever its annotations say."""
    requested = job.network.mode
    mode = requested if requested != "auto" else decisions[ANNOTATION_NETWORK_MODE]
    if mode not in render.MODES:
        raise kopf.PermanentError(f"annotation {ANNOTATION_NETWORK_MODE} must be rdma or tcp, not {mode!r}")
    return mode


def decide(kube: Kube, key: bytes, job: Job, obj: Mapping, write) -> Decisions:
    """The job's decisions: read back from its annotations, or (its first pass) made and recorded.
    `write` reports the network chosen. TokenLost when no token the operator has is the job's."""
    stored = stored_token(kube, job)
    derived = tokens.derive(key, obj["metadata"]["uid"])
    done = recorded(obj)
    if done is not None:
        token = next((t for t in (stored, derived)
                      if t and tokens.fingerprint(t) == done[ANNOTATION_TOKEN_SHA256]), None)
        if token is None:
            raise TokenLost(
                f"Secret {job.secret_name} was deleted or changed and the job's token cannot be restored (the "
                f"operator's token key is not the one the job was created with): running ranks hold a token that "
                f"no new pod would get; delete the job and create it again")
        return Decisions(recorded_mode(job, done), done[ANNOTATION_NETWORK_REASON],
                         done[ANNOTATION_WORKER_IMAGE], token)

    requested = job.network.mode
    earlier = (obj.get("status") or {}).get("network") or {}
    if requested == "auto" and earlier.get("mode") in render.MODES:
        # Decided by an operator version that kept the decision in the status only.
        mode, reason = earlier["mode"], earlier.get("reason") or "decided earlier"
    else:
        mode, reason = network.resolve(job.network, kube.list("v1", "Node") if requested == "auto" else [])
    # A job whose Secret exists already (created by an earlier operator version) keeps its token.
    decisions = Decisions(mode, reason, render.default_worker_image(), stored or derived)
    kube.annotate_job(job.namespace, job.name, {
        ANNOTATION_NETWORK_MODE: decisions.mode,
        ANNOTATION_NETWORK_REASON: decisions.reason,
        ANNOTATION_WORKER_IMAGE: decisions.image,
        ANNOTATION_TOKEN_SHA256: tokens.fingerprint(decisions.token),
    })
    why = reasons.REQUESTED if requested != "auto" else (reasons.RDMA_NODE_FOUND if mode == "rdma" else
                                                         reasons.NO_RDMA_NODE)
    write(set_conditions=[condition(Condition.NETWORK_RESOLVED, True, why, f"network mode {mode}: {reason}")])
    return decisions


def stored_token(kube: Kube, job: Job) -> str | None:
    stored = kube.get("v1", "Secret", job.namespace, job.secret_name)
    value = ((stored or {}).get("data") or {}).get(TOKEN_KEY)
    return base64.b64decode(value).decode(errors="replace") if value else None


