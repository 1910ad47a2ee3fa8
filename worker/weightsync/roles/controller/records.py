"""What the controller reports: one JSON line per delivered version and one at the job's end on
stdout, always; and the same as the job's status.transfer and status.completion, with its own
starts (status.controller), the inference ranks' rejoins (status.rejoins) and their states
(status.receivers, written by receivers.py when one changes): in a cluster
(Env.REPORT_TO_KUBERNETES is "1") through the Kubernetes API (a merge patch of the status
subresource, with the controller pod's ServiceAccount), else into Env.STATUS_FILE when set (the
local runner's stand-in for the status). The controller reads its starts back from there: one that
started again must not silently run the job anew (driver.py).

A transfer's bytes are the bytes delivered: the version's size times the number of inference
ranks; seconds run from the controller's "go" to the last inference rank running on the new
version; GB/s is one over the other (as `weightsync bench` counts them). wireBytes are the bytes
the trainers put on the wire for it: the same as bytes for a whole version, less when deltaRanks
inference ranks got it as a delta (more when some refused a patch and got those buckets again).

Every record also counts in the controller's metrics (runtime/metrics.py), at the same point, so
that the pod's /metrics and the records never tell two stories."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from typing import IO

from weightsync.job import CONTROLLER, GROUP, INFERENCE, PLURAL, VERSION, Env, Job
from weightsync.job.logline import say
from weightsync.runtime.metrics import ControllerMetrics

PATCH_ATTEMPTS = 4


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reporter:
    def __init__(self, job: Job, to_kubernetes: bool, out: IO[str] = sys.stdout, status_file: str | None = None,
                 metrics: ControllerMetrics | None = None):
        self.job, self.out = job, out
        self.metrics = metrics or ControllerMetrics()
        self.rejoined = 0  # the inference ranks' rejoins counted in the metrics so far
        self.api = _custom_objects_api() if to_kubernetes else None
        self.status_file = None if to_kubernetes else (status_file or os.environ.get(Env.STATUS_FILE) or None)
        self.lock = threading.Lock()  # the receivers' thread writes too: one write at a time

    def status(self) -> dict:
        """The job's status as last reported ({} when there is nowhere to read it from)."""
        if self.api is not None:
            return self._read().get("status") or {}
        if self.status_file and os.path.exists(self.status_file):
            with open(self.status_file) as f:
                return json.load(f)
        return {}

    def inference_replicas(self) -> int | None:
        """spec.inference.replicas as the job says it now, in a cluster (the pods' count may change
        while the job runs: spec.inference.maxReplicas); None elsewhere."""
        return None if self.api is None else int(self._read()["spec"]["inference"]["replicas"])

    def _read(self) -> dict:
        """The job's object (its status subresource's, which the controller's ServiceAccount may read)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.api.get_namespaced_custom_object_status(GROUP, VERSION, self.job.namespace, PLURAL, self.job.name)
        except ApiException as e:
            raise RuntimeError(f"cannot read WeightTransferJob {self.job.namespace}/{self.job.name}: "
                               f"{e.status} {e.reason}: {_api_message(e)}") from None

    def started(self, starts: int) -> None:
        """Record a start of the controller (the first is 1)."""
        self._patch({"controller": {"starts": starts, "started": now()}})

    def rejoins(self, rejoins: dict) -> None:
        """{role: how many times its ranks rejoined the running job}."""
        self._line({"event": "rejoins", **rejoins})
        self._patch({"rejoins": rejoins})
        self.metrics.rejoins.inc(max(0, rejoins.get(INFERENCE, 0) - self.rejoined))
        self.rejoined = max(self.rejoined, rejoins.get(INFERENCE, 0))

    def receivers(self, record: dict) -> None:
        """status.receivers (receivers.py says what it holds), replaced whole."""
        self._patch({"receivers": record})

    def transfer(self, version: int, step: int | None, delivered: int, seconds: float, transport: str,
                 loss: float | None, wire_bytes: int | None = None, delta_ranks: int = 0, **extra) -> dict:
        """Report a delivered version: `delivered` bytes (the module's docstring says which) in
        `seconds`; `extra` goes into the line on stdout only."""
        record = {"version": version, "step": step, "bytes": delivered, "seconds": round(seconds, 6),
                  "gbps": round(delivered / seconds / 1e9, 4) if seconds > 0 else 0.0, "time": now(),
                  "transport": transport, "wireBytes": delivered if wire_bytes is None else wire_bytes,
                  "deltaRanks": delta_ranks}
        if loss is not None:
            record["loss"] = round(loss, 6)
        if step is None:  # a training script that did not say
            del record["step"]
        self._line({"event": "transfer", **record, **extra})
        self._patch({"transfer": record})
        self.metrics.round(delivered, record["wireBytes"], seconds, extra.get("stall_seconds"))
        return record

    def completion(self, state: str, message: str, versions: int, reason: str = "", **extra) -> dict:
        record = {"state": state, "message": message, "versions": versions, "time": now()}
        if reason:
            record["reason"] = reason  # why it failed (job/reasons.py), the Failed condition's reason
        self._line({"event": "completion", **record, **extra})
        self._patch({"completion": record})
        if reason:
            self.metrics.failures.labels(reason).inc()
        return record

    def _line(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def _patch(self, status: dict) -> None:
        with self.lock:
            self._write(status)

    def _write(self, status: dict) -> None:
        if self.api is None:
            if self.status_file:
                current = self.status()
                current.update(status)
                tmp = f"{self.status_file}.tmp"
                with open(tmp, "w") as f:
                    json.dump(current, f)
                os.replace(tmp, self.status_file)  # a reader never sees half a status
            return
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        body = {"status": status}
        for attempt in range(PATCH_ATTEMPTS):
            try:
                self.api.patch_namespaced_custom_object_status(
                    GROUP, VERSION, self.job.namespace, PLURAL, self.job.name, body,
                    _content_type="application/merge-patch+json")
                return
            except ApiException as e:
                # 4xx other than throttling will not get better by retrying: say so and go on
                if e.status and e.status < 500 and e.status != 429 or attempt == PATCH_ATTEMPTS - 1:
                    say(CONTROLLER, f"could not write status to WeightTransferJob {self.job.namespace}/{self.job.name}: "
                                    f"{e.status} {e.reason}: {_api_message(e)}")
                    return
            except (OSError, HTTPError) as e:  # the API server is unreachable
                if attempt == PATCH_ATTEMPTS - 1:
                    say(CONTROLLER, f"could not reach the Kubernetes API to write status: {e}")
                    return
            time.sleep(0.5 * 2 ** attempt)


def _api_message(e) -> str:
    try:
        return json.loads(e.body).get("message", e.body)
    except (TypeError, ValueError):
        return str(e.body)


def _custom_objects_api():
    """In a pod: the ServiceAccount's in-cluster config. Outside one (worker processes started
    next to a cluster, as the end-to-end tests do): $KUBECONFIG."""
    from kubernetes import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    elif os.environ.get("KUBECONFIG"):
        config.load_kube_config(config_file=os.environ["KUBECONFIG"])
    else:
        raise RuntimeError("reporting to Kubernetes was asked for, but this process is neither in a pod "
                           "(KUBERNETES_SERVICE_HOST unset) nor given a KUBECONFIG")
    return client.CustomObjectsApi()
