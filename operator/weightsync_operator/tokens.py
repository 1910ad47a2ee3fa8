"""A job's token: derived from the operator's key and the job's uid, so that the operator can
restore a deleted Secret with the very token the running ranks hold, without keeping a copy of
any job's token and without reading a job's Secret to recover it."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path

from weightsync.job.token import mac
from weightsync_operator.kube import ApiError, Kube

# Where the key lives: a Secret in the operator's own namespace (the chart creates it and lets the
# operator read that one Secret only; an operator run by hand creates it where it may).
KEY_SECRET_ENV = "WEIGHTSYNC_TOKEN_KEY_SECRET"
NAMESPACE_ENV = "WEIGHTSYNC_OPERATOR_NAMESPACE"
DEFAULT_KEY_SECRET = "weightsync-token-key"
KEY_FIELD = "key"
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def key_location() -> tuple[str, str]:
    """(namespace, name) of the key's Secret."""
    namespace = os.environ.get(NAMESPACE_ENV)
    if not namespace:
        namespace = IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.exists() else "default"
    return namespace, os.environ.get(KEY_SECRET_ENV) or DEFAULT_KEY_SECRET


def load_key(kube: Kube) -> bytes:
    """The operator's key, created (32 random bytes) if its Secret does not exist yet."""
    namespace, name = key_location()
    for _ in range(2):
        stored = kube.get("v1", "Secret", namespace, name)
        if stored is not None:
            value = (stored.get("data") or {}).get(KEY_FIELD)
            if not value:
                raise RuntimeError(f"Secret {namespace}/{name} holds no '{KEY_FIELD}': the job tokens' key")
            return base64.b64decode(value)
        try:
            kube.request("POST", f"/api/v1/namespaces/{namespace}/secrets", {
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
                "type": "Opaque", "data": {KEY_FIELD: base64.b64encode(secrets.token_bytes(32)).decode()}})
        except ApiError as e:
            if e.status != 409:  # created by someone else meanwhile: read it
                raise RuntimeError(f"the job tokens' key, Secret {namespace}/{name}, does not exist and "
                                   f"cannot be created: {e}") from None
    raise RuntimeError(f"Secret {namespace}/{name} (the job tokens' key) vanished while it was being read")


def derive(key: bytes, uid: str) -> str:
    """The token of the job with this uid: 43 url-safe characters (256 bits)."""
    return base64.urlsafe_b64encode(mac(key, uid)).decode().rstrip("=")


def fingerprint(token: str) -> str:
    """What the job records about its token: enough to recognise it, useless to guess it."""
    return hashlib.sha256(token.encode()).hexdigest()[:32]
