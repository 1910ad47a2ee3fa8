"""The security contexts of a job's pods and worker containers: what Pod Security `restricted`
asks of every pod, and the one exception RDMA forces (pinned memory needs root's IPC_LOCK)."""

from __future__ import annotations

from weightsync.job import WORKER_UID


def pod_security(rdma: bool) -> dict:
    """Every pod but an rdma job's trainers and inference ranks passes Pod Security `restricted`:
    the worker image's own non-root user, the runtime's default seccomp profile. Registering RDMA
    buffers pins memory past the default locked-memory limit; IPC_LOCK lifts that limit only for
    root (Kubernetes gives a non-root user no ambient capabilities), so those pods run as root."""
    if rdma:
        return {"runAsUser": 0, "runAsGroup": 0, "seccompProfile": {"type": "RuntimeDefault"}}
    return {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
            "fsGroup": WORKER_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(rdma: bool) -> dict:
    """No capability but IPC_LOCK for RDMA, no privilege escalation, and a read-only root
    filesystem: the worker writes only under /tmp (WRITABLE_ENV)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if rdma else {})}}
