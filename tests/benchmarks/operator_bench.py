"""Operator benchmark: how long from `kubectl apply` of a WeightTransferJob until all nine of its
children exist, for one job at a time (median of 20) and for 50 jobs applied at once, next to a
baseline in the same run (the same nine objects applied directly with kubectl, no operator); and
the operator's memory (peak resident set, VmHWM) and CPU time.

Starts its own local control plane (hack/cluster/controlplane.py) and runs the operator as
`kopf run`; children are timed by watches on the API server, as they are stored.

    make bench-operator      # or: python tests/benchmarks/operator_bench.py [--single 20] [--many 50]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import secrets
import ssl
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "hack" / "cluster"), str(ROOT / "tests")]
from controlplane import ControlPlane, find_binaries, wait_for  # noqa: E402
from support.operator_harness import CRD, Operator  # noqa: E402

from weightsync.job import API_VERSION, KIND, LABEL_JOB, PLURAL, ROLES, load_job  # noqa: E402
from weightsync_operator import render  # noqa: E402

# Every kind a job owns, and where the API serves it.
KINDS = {
    "Service": "/api/v1/services", "Secret": "/api/v1/secrets", "ConfigMap": "/api/v1/configmaps",
    "ServiceAccount": "/api/v1/serviceaccounts", "Role": "/apis/rbac.authorization.k8s.io/v1/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/rolebindings", "StatefulSet": "/apis/apps/v1/statefulsets",
}
# CPU-only pods, so that 50 jobs fit on the fake nodes; the network is left to auto (rdma here).
# CPU-only ranks on the RDMA nodes, which are GPU nodes and tainted as such: they tolerate it.
GPU_TAINT = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
SPEC = {"model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1024}},
        "trainer": {"replicas": 2, "gpusPerProc": 0, "tolerations": GPU_TAINT},
        "inference": {"replicas": 1, "gpusPerProc": 0, "tolerations": GPU_TAINT}}


class Watches:
    """Cluster-wide watches on every child kind (by the job label); records when each object is
    first seen."""

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        self.seen: dict[tuple[str, str, str], float] = {}
        self.changed = threading.Condition()
        self.ready = threading.Barrier(len(KINDS) + 1)
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._watch, args=(k, p), daemon=True) for k, p in KINDS.items()]
        for t in self.threads:
            t.start()
        self.ready.wait(30)

    def _watch(self, kind: str, path: str):
        try:
            self._stream(kind, path)
        except Exception:
            if not self.stopped.is_set():
                raise

    def _stream(self, kind: str, path: str):
        url = urllib.parse.urlsplit(self.cp.server)
        ctx = ssl.create_default_context(cafile=str(self.cp.ca_file))
        query = urllib.parse.urlencode({"watch": "1", "labelSelector": LABEL_JOB, "allowWatchBookmarks": "false"})
        first = True
        while not self.stopped.is_set():
            conn = http.client.HTTPSConnection(url.hostname, url.port, context=ctx, timeout=3600)
            conn.request("GET", f"{path}?{query}", headers={"Authorization": f"Bearer {self.cp.token}"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"watch {path}: {resp.status} {resp.read()[:300]!r}")
            if first:
                self.ready.wait(30)
                first = False
            while line := resp.readline():
                now = time.monotonic()
                event = json.loads(line)
                meta = event["object"]["metadata"]
                with self.changed:
                    self.seen.setdefault((meta["namespace"], kind, meta["name"]), now)
                    self.changed.notify_all()
            conn.close()

    def wait(self, keys: set, timeout: float = 300) -> float:
        """The time the last of `keys` was first seen."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not keys <= self.seen.keys():
                if not self.changed.wait(max(0.0, deadline - time.monotonic())):
                    missing = sorted(keys - self.seen.keys())
                    raise TimeoutError(f"{len(missing)} children never appeared, e.g. {missing[:3]}")
            return max(self.seen[k] for k in keys)


def children_keys(namespace: str, name: str) -> set:
    job = load_job(job_doc(name), namespace=namespace)
    return {(namespace, "Service", job.service_name), (namespace, "Secret", job.secret_name),
            (namespace, "ConfigMap", job.configmap_name), (namespace, "ServiceAccount", job.service_account_name),
            (namespace, "Role", job.service_account_name), (namespace, "RoleBinding", job.service_account_name),
            *((namespace, "StatefulSet", job.child_name(r)) for r in ROLES)}


def job_doc(name: str) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": SPEC}


def direct_docs(namespace: str, name: str) -> list[dict]:
    """The baseline: the same nine objects the operator would create, applied by kubectl (its
    StatefulSets at zero replicas: the baseline starts no pods, so the nodes hold the measured jobs)."""
    job = load_job(job_doc(name), namespace=namespace)
    return render.children(job, "rdma", secrets.token_urlsafe(32), stopped=True)


def apply(cp: ControlPlane, namespace: str, docs: list[dict]) -> float:
    """Runs `kubectl apply` on the documents; returns the time just before kubectl started."""
    text = yaml.safe_dump_all(docs)
    start = time.monotonic()
    cp.kubectl("-n", namespace, "apply", "-f", "-", input=text, timeout=300)
    return start


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS/VmHWM in KiB and CPU seconds (user+system) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {"rss": int(fields["VmRSS"].split()[0]), "hwm": int(fields["VmHWM"].split()[0]),
            "cpu": (int(stat[11]) + int(stat[12])) / ticks}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.0f} ms"


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))], xs[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", type=int, default=20, help="one-job runs (default 20)")
    parser.add_argument("--many", type=int, default=50, help="jobs applied at once (default 50)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        cp = ControlPlane(Path(tmp) / "cluster", find_binaries(sys.stderr)).up(log=sys.stderr)
        op = watches = None
        try:
            cp.kubectl("apply", "-f", str(CRD))
            cp.wait_served("weighttransferjobs.weightsync.io")
            # 71 jobs' RDMA pods need more room than the default two RDMA nodes' 110 pods each.
            for i in range(2, 4):
                cp.add_node(f"gpu-rdma-{i}", gpus=8, rdma=1000)
            for ns in ("one", "many", "base-one", "base-many"):
                cp.kubectl("create", "namespace", ns)
            watches = Watches(cp)
            op = Operator(Path(cp.kubeconfig), Path(tmp) / "operator.log").start()
            pid = op.proc.pid
            idle = proc_status(pid)

            def job_phase(ns, name):
                out = cp.kubectl("-n", ns, "get", PLURAL, name, "-o", "jsonpath={.status.phase}", check=False)
                return out.stdout.strip()

            # The first job after start is timed apart: kopf opens its API connections for it.
            start = apply(cp, "one", [job_doc("first")])
            first = watches.wait(children_keys("one", "first")) - start
            wait_for("first Running", lambda: job_phase("one", "first") == "Running", 120)

            # One job at a time; the next once the previous is Running (the operator is idle).
            single, base_single = [], []
            for i in range(args.single):
                name = f"one-{i:02d}"
                start = apply(cp, "one", [job_doc(name)])
                single.append(watches.wait(children_keys("one", name)) - start)
                wait_for(f"{name} Running", lambda: job_phase("one", name) == "Running", 120)
                bname = f"base-{i:02d}"
                start = apply(cp, "base-one", direct_docs("base-one", bname))
                base_single.append(watches.wait(children_keys("base-one", bname)) - start)
            after_single = proc_status(pid)

            # Many jobs in one kubectl apply.
            names = [f"many-{i:02d}" for i in range(args.many)]
            start = apply(cp, "many", [job_doc(n) for n in names])
            many = [watches.wait(children_keys("many", n)) - start for n in names]
            wait_for("all jobs Running", lambda: all(
                p == "Running" for p in cp.kubectl("-n", "many", "get", PLURAL, "-o",
                                                   "jsonpath={.items[*].status.phase}").stdout.split())
                and len(cp.kubectl("-n", "many", "get", PLURAL, "-o", "name").stdout.split()) == args.many, 600)
            after_many = proc_status(pid)
            bnames = [f"basemany-{i:02d}" for i in range(args.many)]
            start = apply(cp, "base-many", [d for n in bnames for d in direct_docs("base-many", n)])
            base_many = [watches.wait(children_keys("base-many", n)) - start for n in bnames]
        finally:
            if op:
                op.stop()
            if watches:
                watches.stopped.set()
            cp.down()

    cpus = os.cpu_count()
    print(f"\nweightsync operator benchmark - {platform.machine()}, {cpus} CPUs, local control plane "
          f"(kube-apiserver, controller-manager, scheduler, KWOK on loopback), kopf {_kopf_version()}")
    print("time from `kubectl apply` until all 9 children are stored (watched on the API server):\n")
    print(f"  {'':58} {'median':>11} {'p90':>11} {'max':>11}")
    rows = [
        (f"one job, via the operator (n={len(single)})", single),
        (f"  baseline: its 9 objects applied by kubectl (n={len(base_single)})", base_single),
        (f"{args.many} jobs in one apply, via the operator (per job)", many),
        (f"  baseline: their {9 * args.many} objects applied by kubectl", base_many),
    ]
    for label, xs in rows:
        print(f"  {label:58} " + " ".join(f"{ms(x):>11}" for x in quantiles(xs)))
    print(f"\n  the first job after the operator started: {first * 1000:.0f} ms")
    print(f"  {args.many} jobs: all {9 * args.many} children stored {max(many):.2f} s after the apply began "
          f"(baseline {max(base_many):.2f} s)")
    print("\noperator process (kopf run):")
    print(f"  resident set at idle {idle['rss'] / 1024:.1f} MiB; peak (VmHWM) after {len(single)} single jobs "
          f"{after_single['hwm'] / 1024:.1f} MiB, after {args.many} more at once {after_many['hwm'] / 1024:.1f} MiB")
    print(f"  CPU time: {after_single['cpu'] - idle['cpu']:.1f} s for the single jobs, "
          f"{after_many['cpu'] - after_single['cpu']:.1f} s for the {args.many} jobs "
          f"(creation, status while their pods started)")
    return 0


def _kopf_version() -> str:
    from importlib.metadata import version

    return version("kopf")


if __name__ == "__main__":
    sys.exit(main())
