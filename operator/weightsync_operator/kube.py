"""The few Kubernetes API calls the operator makes, as plain JSON over the client's connection,
and the comparison that decides whether a stored child already is what the job wants."""

from __future__ import annotations

import json
from typing import Any, Mapping

import kubernetes
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from weightsync.job import API_VERSION, KIND, PLURAL

FIELD_MANAGER = "weightsync-operator"
# kind -> plural, for every kind the operator reads or writes.
PLURALS = {
    "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
    "StatefulSet": "statefulsets", "Node": "nodes", "Namespace": "namespaces", "Pod": "pods",
    KIND: PLURAL,
    # Kueue's (kueue.x-k8s.io), for the jobs it admits
    "Workload": "workloads", "ResourceFlavor": "resourceflavors", "WorkloadPriorityClass": "workloadpriorityclasses",
}


class ApiError(Exception):
    """A refused request, with the API server's own message and causes."""

    def __init__(self, status: int, reason: str, message: str, what: str, causes: list | None = None):
        self.status, self.reason, self.message = status, reason, message
        self.causes = [c for c in causes or [] if isinstance(c, dict)]
        super().__init__(f"{what}: {status} {reason}: {message}")

    @property
    def namespace_terminating(self) -> bool:
        """Refused because the namespace is being deleted (not for want of permission): the
        namespace lifecycle admission names the cause NamespaceTerminating."""
        return self.status == 403 and any(c.get("reason") == "NamespaceTerminating" for c in self.causes)


def load_client(connections: int = 10) -> kubernetes.client.ApiClient:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config. `connections`:
    as many as there are handlers calling at once."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    configuration = kubernetes.client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = connections
    return kubernetes.client.ApiClient(configuration)


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{PLURALS[kind]}"
    return base + (f"/{name}" if name else "")


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient, timeout: float = 30):
        self.client = client
        self.timeout = timeout

    def request(self, method: str, resource_path: str, body: Any = None, *,
                query: Mapping[str, Any] | None = None, content_type: str = "application/json") -> dict | None:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        args = self.client.param_serialize(
            method=method, resource_path=resource_path, query_params=list((query or {}).items()),
            header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            response = self.client.call_api(*args, _request_timeout=self.timeout)
            status, data = response.status, response.read()
        except ApiException as e:
            status, data = e.status or 0, (e.body or "").encode()
        if not 200 <= status < 300:
            try:
                refusal = json.loads(data)
            except ValueError:
                refusal = {}
            raise ApiError(status, refusal.get("reason") or "Error",
                           refusal.get("message") or data.decode(errors="replace")[:500],
                           f"{method} {resource_path}", (refusal.get("details") or {}).get("causes"))
        return json.loads(data) if data else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        try:
            return self.request("GET", path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict]:
        return self.request("GET", path(api_version, kind, namespace),
                            query={"labelSelector": selector} if selector else None)["items"]

    def apply(self, obj: Mapping) -> dict:
        """Server-side apply: creates the object or sets exactly the fields the operator owns."""
        meta = obj["metadata"]
        return self.request(
            "PATCH", path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]), dict(obj),
            query={"fieldManager": FIELD_MANAGER, "force": "true"}, content_type="application/apply-patch+yaml")

    def ensure(self, obj: Mapping) -> str:
        """Create-or-compare: 'created', 'patched' (it had drifted) or 'unchanged' (no request
        that writes is made)."""
        meta = obj["metadata"]
        stored = self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if stored is not None and matches(obj, stored):
            return "unchanged"
        self.apply(obj)
        return "created" if stored is None else "patched"

    def patch_status(self, obj: Mapping, status: Mapping) -> dict:
        """A merge patch of another object's status, refused (409) when it changed since `obj` was read."""
        meta = obj["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": dict(status)}
        return self.request("PATCH", path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]) + "/status",
                            body, content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        """Deletes the object if it is there (a 404 is not an error)."""
        try:
            self.request("DELETE", path(api_version, kind, namespace, name), query={"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise

    def namespace_terminating(self, namespace: str) -> bool:
        """Whether the namespace is being deleted (or gone): nothing can be created in it."""
        try:
            stored = self.get("v1", "Namespace", None, namespace)
        except ApiError:
            return False
        return stored is None or (stored.get("status") or {}).get("phase") == "Terminating"

    def get_job(self, namespace: str, name: str) -> dict | None:
        return self.get(API_VERSION, KIND, namespace, name)

    def annotate_job(self, namespace: str, name: str, annotations: Mapping[str, str]) -> dict:
        return self.request("PATCH", path(API_VERSION, KIND, namespace, name),
                            {"metadata": {"annotations": dict(annotations)}}, content_type="application/merge-patch+json")

    def patch_job_status(self, namespace: str, name: str, status: Mapping, resource_version: str | None = None) -> dict:
        """A merge patch of the job's status; with resource_version, refused (409) when the job
        changed since it was read."""
        body: dict = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.request("PATCH", path(API_VERSION, KIND, namespace, name) + "/status", body,
                            content_type="application/merge-patch+json")


_QUANTITY_PARENTS = {"limits", "requests"}


def matches(desired: Any, stored: Any, where: tuple = ()) -> bool:
    """Whether every field the operator sets has that value in the stored object. Fields the API
    server adds (defaults, status, metadata) do not matter; an empty or false desired value
    matches an absent field; resource quantities compare by value ("0.5" == "500m")."""
    if isinstance(desired, dict):
        if stored is None:
            return not desired
        return isinstance(stored, dict) and all(matches(v, stored.get(k), where + (k,)) for k, v in desired.items())
    if isinstance(desired, list):
        stored = [] if stored is None else stored
        return (isinstance(stored, list) and len(desired) == len(stored)
                and all(matches(d, s, where) for d, s in zip(desired, stored)))
    if stored is None:
        return desired is None or desired is False or desired == ""
    if desired == stored:
        return True
    if len(where) >= 2 and where[-2] in _QUANTITY_PARENTS or where[-1:] == ("sizeLimit",):
        try:
            return parse_quantity(desired) == parse_quantity(stored)
        except ValueError:
            return False
    return False
