"""End to end, the way a user runs weightsync: the chart installed with helm, the operator running
as the chart's Deployment pod from the operator image (with that pod's ServiceAccount, so the
chart's RBAC is all it has), jobs applied with kubectl from examples/. Pods that need no GPU run
as containers of the worker image on the real node (hack/node): the tcp example trains,
transfers over the pod network, reports through the API and is ended by the operator. Pods that
need GPUs and RDMA land on KWOK's fake nodes, which run nothing."""

from __future__ import annotations

import base64
import json
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from controlplane import wait_for
from e2e_harness import (
    LogFollower,
    Prometheus,
    apply,
    assert_succeeded,
    drop_claim,
    example,
    fast,
    finished,
    following,
    get_job,
    host_claim,
    install,
    job_pods,
    mounted,
    new_namespace,
    phase_in,
    pods,
    restarts,
    restricted,
    running,
    show_logs,
    small,
)
from kubernetes.utils import parse_quantity

import weightsync
from weightsync.job import (
    CONTROLLER,
    INFERENCE,
    KIND,
    LABEL_JOB,
    LABEL_ROLE,
    LIVENESS,
    PLURAL,
    POD_INDEX_LABEL,
    ROLES,
    STORE_PORT,
    TOKEN_KEY,
    TRAINER,
    load_job,
)
from weightsync.runtime.faults import PAUSE_DIR_ENV, PAUSE_LIMIT_ENV

pytestmark = pytest.mark.cluster

RDMA = "rdma/rdma_shared_device_a"
GPU = "nvidia.com/gpu"





def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env") or []}


def events(cluster, namespace: str, name: str) -> list[dict]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                          f"involvedObject.kind={KIND},involvedObject.name={name}", "-o", "json").stdout
    return json.loads(out)["items"]


def all_running(cluster, namespace: str, name: str, count: int) -> dict[str, dict] | None:
    """The job's pods once all `count` of them are Running."""
    found = job_pods(cluster, namespace, name)
    return found if len(found) == count and all(running(p) for p in found.values()) else None



def printed_columns(cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get wtj NAME` as a user reads it: header -> value."""
    header, row = cluster.kubectl("get", "wtj", name, "-n", namespace).stdout.splitlines()
    starts = [0] + [i for i in range(1, len(header)) if header[i] != " " and header[i - 1] == " " and header[i - 2] == " "]
    bounds = list(zip(starts, starts[1:] + [None]))
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


def owned_leftovers(cluster, namespace: str, name: str) -> list[str]:
    kinds = "statefulsets,services,secrets,configmaps,serviceaccounts,roles,rolebindings,pods"
    return cluster.kubectl("get", kinds, "-n", namespace, "-l", f"{LABEL_JOB}={name}", "-o", "name").stdout.split()




# ---------------------------------------------------------------------------------- tcp, for real



def test_tcp_example_runs_in_real_pods_to_succeeded(cluster, real_node, helm, namespace, chart, operator_from_chart,
                                                    tmp_path):
    job = fast(example("tcp-job.yaml"))
    name = job["metadata"]["name"]
    loaded = load_job(job, namespace)
    spec, layout = loaded.spec, loaded.layout
    assert spec["network"]["mode"] == "tcp"
    logs = LogFollower(cluster, namespace, tmp_path / "logs")
    restricted(cluster, namespace)  # a tcp job's pods need nothing more

    with operator_from_chart(chart[1], chart[0]) as operator, \
            Prometheus(cluster, chart[1], chart[0], tmp_path / "prometheus") as prometheus:
        # The operator image runs as the non-root user the chart names, on a read-only root.
        assert operator.exec("id", "-u").stdout.strip() == "65532"
        assert operator.exec("touch", "/probe").returncode != 0

        apply(cluster, namespace, job)

        def progress():
            operator.check()
            for pod in job_pods(cluster, namespace, name).values():
                logs.follow(pod)
                if restarts(pod) and pod["metadata"]["name"] in logs.procs:
                    raise AssertionError(f"pod {pod['metadata']['name']} restarted:\n"
                                         f"{logs.text(pod['metadata']['name'])[-4000:]}")

        scheduled = wait_for(f"{layout.pods} pods of {name} Running",
                             lambda: all_running(cluster, namespace, name, layout.pods), 180, failed=progress)
        by_ordinal = {int(p["metadata"]["labels"][POD_INDEX_LABEL]): p for p in scheduled.values()}
        assert sorted(by_ordinal) == list(range(layout.pods))
        for ordinal, pod in by_ordinal.items():
            assert pod["spec"]["nodeName"] == real_node.name, pod["metadata"]["name"]
            assert pod["metadata"]["labels"][LABEL_ROLE] == layout.role_of(ordinal)
            if ordinal > 0:
                assert env_of(pod)["NCCL_IB_DISABLE"] == "1"
            assert RDMA not in pod["spec"]["containers"][0].get("resources", {}).get("requests", {})

        try:
            done = wait_for(f"{name} Succeeded", lambda: phase_in(cluster, namespace, name, ("Succeeded", "Failed")),
                            600, interval=1, failed=progress)
            status = assert_succeeded(cluster, namespace, done, logs)
            # The operator ended the job: its pods stop (the kubelet stops their containers).
            wait_for(f"pods of {name} gone", lambda: not job_pods(cluster, namespace, name), 120)
            scraped = scraped_figures(prometheus, namespace, name, operator)
        finally:
            logs.stop()
            for pod_name in sorted(logs.procs):
                print(f"--- kubectl logs {pod_name}:\n{logs.text(pod_name)[-1500:]}")

    # Each role's progress, as `kubectl logs` showed it.
    versions = 1 + spec["training"]["steps"] // spec["transfer"]["everySteps"]
    role_logs = {role: [logs.text(n) for n, p in scheduled.items() if p["metadata"]["labels"][LABEL_ROLE] == role]
                 for role in ROLES}
    for text in role_logs[TRAINER]:
        assert re.search(rf"version {versions - 1} at step {spec['training']['steps']}.*: sent \d+ bytes", text), text
    for text in role_logs[INFERENCE]:
        assert f"switched to version {versions - 1} (digest verified)" in text, text
        assert re.search(r"version \d+ generates", text), text
    (controller_log,) = role_logs[CONTROLLER]
    reported = [json.loads(line) for line in controller_log.splitlines() if line.startswith("{")]
    last = [r for r in reported if r.get("event") == "transfer"][-1]

    # What a real Prometheus scraped from the job's pods, with the chart's scrape configuration,
    # agrees with the job's status and the controller's reports: every pod's final figures were read
    # before it stopped.
    inference = layout.world_size(INFERENCE)
    assert scraped["versions"] == status["completion"]["versions"] == versions, scraped
    assert scraped["delivered"] == sum(r["bytes"] for r in reported if r.get("event") == "transfer"), scraped
    assert scraped["wire"] == sum(r["wireBytes"] for r in reported if r.get("event") == "transfer"), scraped
    assert scraped["current"] == inference and scraped["version"] == versions - 1, scraped
    assert scraped["serving"] == {str(r): versions - 1 for r in range(inference)}, scraped

    # The controller's reports arrived through the API (the kubernetes Service, from inside its
    # pod) with the job's own ServiceAccount...
    transfer, completion = status["transfer"], status["completion"]
    assert completion["state"] == "Succeeded" and completion["versions"] == versions
    assert transfer["version"] == versions - 1 and transfer["bytes"] > 0 and transfer["gbps"] > 0
    assert transfer["transport"] == "tcp"
    assert {k: last[k] for k in ("version", "bytes", "gbps")} == {k: transfer[k] for k in ("version", "bytes", "gbps")}
    who = f"system:serviceaccount:{namespace}:{name}-controller"
    allowed = cluster.kubectl("auth", "can-i", f"--as={who}", "patch", f"weighttransferjobs.weightsync.io/{name}",
                              "--subresource=status", "-n", namespace, check=False).stdout.strip()
    other = cluster.kubectl("auth", "can-i", f"--as={who}", "patch", "weighttransferjobs.weightsync.io/another-job",
                            "--subresource=status", "-n", namespace, check=False).stdout.strip()
    assert (allowed, other) == ("yes", "no")

    # ...and the operator ended the job: Succeeded, every StatefulSet scaled to zero.
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Completed"]["status"] == "True"
    assert status["network"]["mode"] == "tcp"
    for role in ROLES:
        sts = json.loads(cluster.kubectl("get", "statefulset", f"{name}-{role}", "-n", namespace, "-o", "json").stdout)
        assert sts["spec"]["replicas"] == 0, role

    shown = printed_columns(cluster, namespace, name)
    print(cluster.kubectl("get", "wtj", name, "-n", namespace).stdout)
    assert shown["PHASE"] == "Succeeded" and shown["NETWORK"] == "tcp"
    assert int(shown["VERSION"]) == versions - 1
    assert float(shown["GB/S"]) == pytest.approx(transfer["gbps"])

    # Deleting the job leaves nothing of it; uninstalling the chart leaves nothing of the operator.
    cluster.kubectl("delete", "wtj", name, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(f"everything of {name} gone", lambda: not owned_leftovers(cluster, namespace, name), 60)
    release, ops = chart
    helm("uninstall", release, "--namespace", ops, "--wait")
    wait_for("nothing of the chart left", lambda: not chart_leftovers(cluster, release, ops), 120)


def test_a_running_jobs_inference_pods_come_back_when_deleted_and_scale_up_and_down_in_real_pods(
        cluster, real_node, helm, namespace, chart, operator_from_chart, tmp_path):
    """spec.inference.maxReplicas 3, two inference pods at first; the trainers train until the job
    is deleted (steps 0). Once version 1 is delivered, a user (or a node drain) deletes the first
    inference pod while `kubectl scale wtj` to 3 starts a third: the StatefulSet starts the deleted
    one again under its name and ordinal and its rank rejoins (the job's status counts the rejoin),
    the third's rank joins the running job, and each serves once a version is verified on it. Then
    to 1 removes the two others, and the versions go on to the one that came back without a failure.
    (A job that ends Succeeded after a pod of it was deleted: the user's trainers' test below.)"""
    job = small(example("tcp-job.yaml"), steps=0)
    job["metadata"]["name"] = name = "elastic"
    job["spec"]["inference"].update(replicas=2, maxReplicas=3)
    # Its one trainer never stops: capped at a quarter of a core, it leaves the node's cores to the
    # pods that start beside it (a version still comes every few seconds).
    job["spec"]["trainer"].update(replicas=1)
    job["spec"]["trainer"]["resources"]["limits"] = {"cpu": "250m"}
    layout = load_job(job, namespace).layout
    first = layout.first_ordinal(INFERENCE)
    victim, new = f"{name}-{INFERENCE}-{first}", f"{name}-{INFERENCE}-{first + 2}"
    logs = LogFollower(cluster, namespace, tmp_path / "logs")

    def status() -> dict:
        return get_job(cluster, namespace, name).get("status") or {}

    def receivers() -> dict:
        return status().get("receivers") or {}

    def state(pod: str) -> list[str]:
        return [r["state"] for r in receivers().get("ranks", []) if r["pod"] == pod]

    def since_its_last_start(pod: str) -> str:
        """What the pod's last container said, once its log holds a second start (the pod came back)."""
        starts = logs.text(pod).split("] on cpu, ")
        return starts[-1] if len(starts) > 2 else ""

    switched = re.compile(r"switched to version \d+ \(digest verified\)")
    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        progress = following(cluster, namespace, name, operator, logs)
        try:
            wait_for(f"{name} to deliver version 1", lambda: (status().get("transfer") or {}).get("version", -1) >= 1,
                     300, interval=1, failed=progress)
            assert receivers()["total"] == 2
            first_uid = job_pods(cluster, namespace, name)[victim]["metadata"]["uid"]
            cluster.kubectl("delete", "pod", victim, "-n", namespace, "--wait=false")
            cluster.kubectl("scale", PLURAL, name, "-n", namespace, "--replicas=3")
            wait_for(f"{victim} back as a new pod", lambda: (job_pods(cluster, namespace, name).get(victim) or {}).get(
                "metadata", {}).get("uid") not in (None, first_uid), 120, failed=progress)
            # a rank that rejoined is current again only once it verified a version after its rejoin
            wait_for(f"{victim}'s rank rejoined and current, and the new rank current", lambda: (
                (status().get("rejoins") or {}).get(INFERENCE, 0) >= 1
                and state(victim) == ["current"] and state(new) == ["current"]), 240, interval=1, failed=progress)
            assert receivers()["total"] == 3
            # each one's line comes once the version generated, after the status says current
            wait_for(f"{victim} (since it came back) and {new} to say they switched", lambda: (
                switched.search(since_its_last_start(victim)) and switched.search(logs.text(new))), 120, interval=1,
                failed=progress)
            reached = status()["transfer"]["version"]
            cluster.kubectl("scale", PLURAL, name, "-n", namespace, "--replicas=1")
            wait_for("one rank left, and a version more", lambda: receivers().get("total") == 1 and
                     status()["transfer"]["version"] > reached, 240, interval=1, failed=progress)
            assert status()["phase"] == "Running" and receivers()["ranks"][0]["state"] == "current"
            assert receivers()["ranks"][0]["pod"] == victim
        finally:
            # It trains until deleted: its pods go before the next test, which needs the node's cores,
            # and before its logs are shown, whose streams end as its containers do.
            cluster.kubectl("delete", PLURAL, name, "-n", namespace, "--wait=false", check=False)
            wait_for(f"{name}'s pods gone", lambda: not job_pods(cluster, namespace, name), 120)
            show_logs(logs)
    (controller,) = [n for n in logs.procs if n.endswith(f"-{CONTROLLER}-0")]
    said = logs.text(controller)
    assert re.search(rf"inference rank 0 rejoined \(start \d+, pod {victim},", said), said[-3000:]
    assert "inference rank 2 joined the running job (start 1" in said, said[-3000:]
    assert "inference rank 1 leaves the job: its pod was scaled away" in said, said[-3000:]
    assert "taken in at version" in logs.text(new)


def test_the_model_from_a_persistent_volume_claim_in_real_pods(cluster, real_node, helm, namespace, chart,
                                                              operator_from_chart, tmp_path):
    """examples/pvc-job.yaml: spec.model.path inside a volume the pod templates mount, as a
    cluster holds its checkpoints: its claim bound to a hostPath PersistentVolume on the real node,
    holding a checkpoint of a small GPT-2 whose weights only it has (all zero). The trainers start
    from it: version 0, verified on every inference rank, generates only token 0, as zero weights do
    (random ones would not)."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightsync.model.config import config_of

    job = fast(example("pvc-job.yaml"))
    job["spec"]["training"].update(seqLen=32)  # what the small model's 32 positions hold
    for role in ("trainer", "inference"):  # where the model comes from is what counts: one pod of each role
        job["spec"][role]["replicas"] = 1
    name = job["metadata"]["name"]
    model = load_job(small(example("tcp-job.yaml")), namespace).model  # the checkpoint's model, from its config
    folder = Path(tempfile.mkdtemp(prefix="weightsync-pv-"))  # outside pytest's 0700 folders: the pods read it
    try:
        checkpoint = AutoModelForCausalLM.from_config(config_of(model))
        with torch.no_grad():
            for param in checkpoint.parameters():
                param.zero_()
        checkpoint.save_pretrained(folder / "gpt2")
        for path in (folder, *folder.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        host_claim(cluster, namespace, "models", folder, "ReadOnlyMany")
        assert job["spec"]["model"]["path"] == "/models/gpt2"
        logs = LogFollower(cluster, namespace, tmp_path / "logs")
        with operator_from_chart(chart[1], chart[0]) as operator:
            apply(cluster, namespace, job)
            try:
                done = finished(cluster, namespace, name, following(cluster, namespace, name, operator, logs))
            finally:
                show_logs(logs)
        assert_succeeded(cluster, namespace, done, logs)
        inference = [n for n in logs.procs if f"-{INFERENCE}-" in n]
        assert inference
        for pod in inference:
            assert re.search(r"switched to version 0 \(digest verified\); version 0 generates \[0(, 0)*\]",
                             logs.text(pod)), logs.text(pod)[-2000:]
    finally:
        cluster.kubectl("delete", "wtj", name, "-n", namespace, "--ignore-not-found", "--wait=true", "--timeout=60s",
                        check=False)
        drop_claim(cluster, namespace, "models")
        shutil.rmtree(folder, ignore_errors=True)


def test_your_own_training_script_runs_as_the_trainers_in_real_pods_and_resumes_from_its_checkpoint(
        cluster, real_node, helm, namespace, chart, operator_from_chart, tmp_path):
    """examples/user-trainer-job.yaml as a user applies it: torchrun runs the example FSDP2 script in
    each of the two trainer pods, whose four ranks find each other through the job's Service
    (MASTER_ADDR) and attach to the job; here the inference side is a replica of TP degree 2 over
    two pods (its process group over the pod network) beside a whole replica. The script saves its
    checkpoint to a ReadWriteMany claim the trainer pods mount; once version 1 is delivered a
    trainer pod is deleted, as a node drain does, whatever the job is doing then: its StatefulSet
    starts it again, every trainer rank resumes from the checkpoint, and the job succeeds with every
    version verified. Smaller CPU requests than the example, for a 2-core node."""
    job = example("user-trainer-job.yaml")
    name, steps, every = job["metadata"]["name"], 24, 3  # versions enough to outlast the deletion
    args = job["spec"]["trainer"]["args"]
    args[args.index("--steps") + 1], args[args.index("--publish-every") + 1] = str(steps), str(every)
    args += ["--checkpoint", "/checkpoints"]
    job["spec"]["trainer"]["podTemplate"] = mounted("checkpoints", "/checkpoints")
    job["spec"]["inference"].update(replicas=3, tensorParallelSizes=[2, 1])
    for role in ("trainer", "inference"):
        job["spec"][role]["resources"]["requests"]["cpu"] = "200m"
    layout = load_job(job, namespace).layout
    trainers = [f"{name}-{TRAINER}-{ordinal}" for ordinal in layout.ordinals(TRAINER)]
    logs = LogFollower(cluster, namespace, tmp_path / "logs")
    restricted(cluster, namespace)
    folder = Path(tempfile.mkdtemp(prefix="weightsync-checkpoints-"))  # outside pytest's 0700 folders
    folder.chmod(0o777)  # the trainers write it as the image's unprivileged user
    host_claim(cluster, namespace, "checkpoints", folder, "ReadWriteMany")
    try:
        with operator_from_chart(chart[1], chart[0]) as operator:
            apply(cluster, namespace, job)
            progress = following(cluster, namespace, name, operator, logs)
            try:
                wait_for(f"{name} to deliver version 1", lambda: (((get_job(cluster, namespace, name).get("status") or {})
                                                                   .get("transfer") or {}).get("version", -1) >= 1),
                         300, interval=1, failed=progress)
                first_uid = job_pods(cluster, namespace, name)[trainers[-1]]["metadata"]["uid"]
                cluster.kubectl("delete", "pod", trainers[-1], "-n", namespace, "--wait=false")
                wait_for(f"{trainers[-1]} back as a new pod", lambda: (job_pods(cluster, namespace, name).get(
                    trainers[-1]) or {}).get("metadata", {}).get("uid") not in (None, first_uid), 120, failed=progress)
                done = finished(cluster, namespace, name, progress)
            finally:
                show_logs(logs)
    finally:
        drop_claim(cluster, namespace, "checkpoints")
        shutil.rmtree(folder, ignore_errors=True)
    status = assert_succeeded(cluster, namespace, done, logs)
    assert status["rejoins"][TRAINER] >= 1, json.dumps(status, indent=1)
    # every step published once, one of them perhaps twice (the checkpoint a step behind the delivery)
    assert status["completion"]["versions"] >= 1 + steps // every, json.dumps(status, indent=1)
    final = status["transfer"]["version"]
    (controller,) = [n for n in logs.procs if n.endswith(f"-{CONTROLLER}-0")]
    assert "every trainer rank resumed" in logs.text(controller), logs.text(controller)[-3000:]
    # each trainer pod's last start: its ranks attached, resumed from the checkpoint, and finished
    # (the operator removed the pods as the scripts finished: torchrun was not cut short)
    last = {n: logs.text(n).rsplit("runs the command", 1)[-1] for n in trainers}
    attached = "".join(last.values())
    for rank in range(layout.world_size(TRAINER)):
        assert f"[trainer rank {rank}] attached on cpu" in attached, attached[-3000:]
        assert f"[trainer rank {rank}] resumed (start " in attached, attached[-3000:]
    assert "resumed from the checkpoint of step " in attached, attached[-3000:]
    assert f"step {steps}: version {final}, sent" in attached  # the script's own line, from its rank 0
    assert "SignalException" not in attached, attached[-3000:]
    for ordinal in layout.ordinals(INFERENCE):
        text = logs.text(f"{name}-{INFERENCE}-{ordinal}")
        assert f"switched to version {final} (digest verified)" in text, text[-3000:]
    first = logs.text(f"{name}-{INFERENCE}-{layout.first_ordinal(INFERENCE)}")
    assert "TP rank 0 of 2" in first, first[-3000:]


HELD_MID_SEND = 60  # seconds; the operator's liveness probe gives up on a pod after 20 to 25


def test_trainers_of_your_own_join_through_the_jobs_join_secret_in_real_pods(cluster, real_node, helm, namespace, chart,
                                                                            operator_from_chart, tmp_path):
    """examples/external-trainers-job.yaml and -batchjob.yaml applied together, as a user applies
    them: the operator runs the controller and the inference pods and makes the Secret
    "<job>-join"; the user's batch/v1 Job runs torchrun with the example script (2 ranks in one
    pod, the Secret as its environment), whose ranks join the job and deliver every version. The
    WeightTransferJob's deletion takes what the operator made, never the user's Job.

    Trainer rank 0 holds in the middle of sending the last version for HELD_MID_SEND seconds (a
    test hook in the user's own pod): the inference pod's receive of it lasts longer than its
    liveness probe's deadline, which must not cost the pod a restart (its probe asks whether the
    rank's process runs, not whether a version is on its way)."""
    job, trainers = example("external-trainers-job.yaml"), example("external-trainers-batchjob.yaml")
    name, steps, every = job["metadata"]["name"], 3, 3
    (container,) = trainers["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": f"{name}-join"}}]
    assert container["image"] == f"ghcr.io/weightsync/worker:{weightsync.__version__}"  # what the chart defaults to
    args = container["args"]
    args[args.index("--steps") + 1], args[args.index("--publish-every") + 1] = str(steps), str(every)
    container["resources"]["requests"]["cpu"] = job["spec"]["inference"]["resources"]["requests"]["cpu"] = "200m"
    job["spec"]["inference"]["replicas"] = 1  # the trainers are what is tested here
    versions, user_job = 1 + steps // every, trainers["metadata"]["name"]
    assert LIVENESS.period_seconds * LIVENESS.failure_threshold < HELD_MID_SEND
    assert job["spec"]["transfer"]["timeoutSeconds"] > HELD_MID_SEND + 30
    # the hook's point armed before torchrun starts (faults.pause_point), in a folder of the pod's own
    container["command"] = ["sh", "-c", f'touch /pause/trainer-0-mid-send-v{versions - 1}.arm && exec "$0" "$@"',
                            *container["command"]]
    container["env"] += [{"name": PAUSE_DIR_ENV, "value": "/pause"},
                         {"name": PAUSE_LIMIT_ENV, "value": str(HELD_MID_SEND)}]
    container["volumeMounts"] = [{"name": "pause", "mountPath": "/pause"}]
    trainers["spec"]["template"]["spec"]["volumes"] = [{"name": "pause", "emptyDir": {}}]
    restarted: set[str] = set()
    logs = LogFollower(cluster, namespace, tmp_path / "logs")
    restricted(cluster, namespace)  # the user's Job as written passes it too

    def users_pods():
        return pods(cluster, namespace, f"batch.kubernetes.io/job-name={user_job}")

    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        apply(cluster, namespace, trainers)  # its pod waits for the Secret if it comes first
        job_progress = following(cluster, namespace, name, operator, logs)

        def progress():
            job_progress()
            restarted.update(p["metadata"]["name"] for p in job_pods(cluster, namespace, name).values() if restarts(p))
            for pod in users_pods():
                logs.follow(pod)
                if pod["status"].get("phase") == "Failed":
                    out = cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"], check=False)
                    raise AssertionError(f"the user's trainer pod failed:\n{out.stdout[-4000:]}{out.stderr}")
            assert not cluster.kubectl("get", "statefulset", f"{name}-{TRAINER}", "-n", namespace,
                                       "--ignore-not-found", "-o", "name").stdout.strip()

        try:
            done = finished(cluster, namespace, name, progress)
            wait_for(f"the user's Job {user_job} complete", lambda: json.loads(cluster.kubectl(
                "get", "job", user_job, "-n", namespace, "-o", "json").stdout)["status"].get("succeeded"), 120,
                failed=progress)
        finally:
            show_logs(logs)
    status = assert_succeeded(cluster, namespace, done, logs)
    assert status["completion"]["versions"] == versions and status["transfer"]["transport"] == "tcp"
    # the last version was on its way for longer than the inference pod's liveness deadline, and
    # the pod lived through it
    assert status["transfer"]["version"] == versions - 1 and status["transfer"]["seconds"] >= HELD_MID_SEND, status
    assert not restarted, f"restarted while a version was on its way: {sorted(restarted)}"
    assert status["replicas"][TRAINER]["summary"] == "external (2 ranks)"
    assert printed_columns(cluster, namespace, name)["TRAINERS"] == "external (2 ranks)"
    (user_pod,) = users_pods()
    attached = logs.text(user_pod["metadata"]["name"])
    for rank in range(2):
        assert f"[trainer rank {rank}] attached on cpu" in attached, attached[-3000:]
    assert f"step {steps}: version {versions - 1}, sent" in attached, attached[-3000:]
    loaded = load_job(job, namespace)
    for ordinal in loaded.layout.ordinals(INFERENCE):
        text = logs.text(f"{name}-{INFERENCE}-{ordinal}")
        assert f"switched to version {versions - 1} (digest verified)" in text, text[-3000:]

    # What the user's processes joined with: the controller where the job's pods dial it, the
    # job, and the token Secret's own token.
    def secret(which: str) -> dict[str, str]:
        data = json.loads(cluster.kubectl("get", "secret", which, "-n", namespace, "-o", "json").stdout)["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    assert secret(f"{name}-join") == {"WEIGHTSYNC_CONTROLLER": f"{loaded.controller_host}:{STORE_PORT}",
                                      "WEIGHTSYNC_JOB_ID": f"{namespace}/{name}",
                                      "WEIGHTSYNC_TOKEN": secret(f"{name}-token")[TOKEN_KEY]}

    cluster.kubectl("delete", "wtj", name, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(f"everything of {name} gone", lambda: not owned_leftovers(cluster, namespace, name), 60)
    assert cluster.kubectl("get", "job", user_job, "-n", namespace, "-o", "name").stdout.strip() == f"job.batch/{user_job}"




def scraped_figures(prometheus: Prometheus, namespace: str, name: str, operator) -> dict:
    """A finished job's figures as PromQL over Prometheus' HTTP API reads them back, once the
    operator's metrics show the job Succeeded: the controller's counters and gauges (their last
    samples, from before its pod went), and the version each inference rank served last."""
    job = f'namespace="{namespace}",wtj="{name}"'

    def one(promql: str) -> float:
        values = list(prometheus.query(promql).values())
        assert len(values) == 1, f"{promql}: {values}\ntargets: {prometheus.targets()}"
        return values[0]

    wait_for("the operator's metrics to show the job Succeeded",
             lambda: prometheus.query('weightsync_operator_jobs{phase="Succeeded"}') and
             one('weightsync_operator_jobs{phase="Succeeded"}') == 1, 60, failed=operator.check)
    serving = prometheus.query(f'last_over_time(weightsync_serving_version{{{job},role="inference"}}[30m])')
    return {"versions": one(f"max_over_time(weightsync_versions_delivered_total{{{job}}}[30m])"),
            "delivered": one(f"max_over_time(weightsync_delivered_bytes_total{{{job}}}[30m])"),
            "wire": one(f"max_over_time(weightsync_wire_bytes_total{{{job}}}[30m])"),
            "version": one(f"last_over_time(weightsync_version{{{job}}}[30m])"),
            "current": one(f'last_over_time(weightsync_receivers{{{job},state="current"}}[30m])'),
            "serving": {dict(labels)["rank"]: value for labels, value in serving.items()}}



def chart_leftovers(cluster, release: str, namespace: str) -> list[str]:
    selector = f"app.kubernetes.io/instance={release}"
    return (cluster.kubectl("get", "deployments,pods,serviceaccounts,roles,rolebindings", "-n", namespace, "-l",
                            selector, "-o", "name").stdout.split()
            + cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l", selector, "-o", "name").stdout.split())


# ---------------------------------------------------------------------------------- rdma placement


@pytest.fixture
def more_rdma_nodes(cluster):
    """Room for the rdma example as written: four RDMA nodes of 8 GPUs in all."""
    added = [f"gpu-rdma-extra-{i}" for i in range(2)]
    for node in added:
        cluster.add_node(node, gpus=8, rdma=1000)
    yield
    for node in added:
        cluster.delete_node(node)


def test_rdma_example_lands_on_rdma_nodes_with_its_settings(cluster, more_rdma_nodes, namespace, chart,
                                                            operator_from_chart):
    # the nodes before the namespace: its pods go with it while their nodes are still there (the pods
    # of a deleted node wait for the pod garbage collector, a minute)
    job = example("rdma-job.yaml")
    loaded = load_job(job, namespace)
    name, spec, layout = job["metadata"]["name"], loaded.spec, loaded.layout
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    rdma_nodes = {n["metadata"]["name"] for n in nodes if RDMA in n["status"]["allocatable"]}

    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        scheduled = wait_for(f"{layout.pods} pods of {name} Running",
                             lambda: all_running(cluster, namespace, name, layout.pods), 90, failed=operator.check)
        status = wait_for(f"{name} Running", lambda: phase_in(cluster, namespace, name, ("Running",)), 60,
                          failed=operator.check)["status"]

    assert status["network"]["mode"] == "rdma"
    rdma = spec["network"]["rdma"]
    for pod_name, pod in scheduled.items():
        container = pod["spec"]["containers"][0]
        requests = container.get("resources", {}).get("requests", {})
        env = env_of(pod)
        if pod["metadata"]["labels"][LABEL_ROLE] == CONTROLLER:
            assert GPU not in requests and RDMA not in requests, pod_name
            continue
        assert pod["spec"]["nodeName"] in rdma_nodes, (pod_name, pod["spec"]["nodeName"])
        gpus = str(spec["trainer"]["procsPerPod"] * spec["trainer"]["gpusPerProc"])
        assert requests[RDMA] == str(rdma["resourceCount"]) and requests[GPU] == gpus
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert pod["spec"]["securityContext"]["runAsUser"] == 0  # IPC_LOCK lifts the memlock limit only for root
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm"}
        assert env["NCCL_IB_DISABLE"] == "0"
        assert env["NCCL_IB_HCA"] == env["UCCL_P2P_RDMA_DEV"] == ",".join(rdma["hcas"])
        assert env["NCCL_IB_GID_INDEX"] == env["UCCL_P2P_RDMA_GID_INDEX"] == str(rdma["gidIndex"])
        assert env["NCCL_IB_TC"] == env["UCCL_P2P_RDMA_TC"] == str(rdma["trafficClass"])
        assert env["NCCL_IB_SL"] == env["UCCL_P2P_RDMA_SL"] == str(rdma["serviceLevel"])
        assert env["NCCL_NET_GDR_LEVEL"] == rdma["gdrLevel"]
    print(f"{name}: placed on {sorted({p['spec']['nodeName'] for p in scheduled.values()})}; its workers need GPUs "
          "and RDMA NICs, which this machine does not have, so they are not started here")


# ---------------------------------------------------------------------------------- auto fallback


@pytest.fixture
def no_rdma_nodes(cluster):
    """The cluster without its RDMA nodes, put back afterwards."""
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    removed = [(n["metadata"]["name"], n["status"]["allocatable"]) for n in nodes if RDMA in n["status"]["allocatable"]]
    for node, _ in removed:
        cluster.delete_node(node)
    yield
    for node, allocatable in removed:
        cluster.add_node(node, gpus=int(parse_quantity(allocatable.get(GPU, 0))), rdma=int(parse_quantity(allocatable[RDMA])))


def test_auto_on_a_cluster_without_rdma_falls_back_to_tcp_with_an_event(cluster, namespace, chart, operator_from_chart,
                                                                        no_rdma_nodes):
    job = example("rdma-job.yaml")
    job["metadata"]["name"] = "auto-example"
    job["spec"]["network"]["mode"] = "auto"
    name = job["metadata"]["name"]
    with operator_from_chart(chart[1], chart[0]) as operator:
        apply(cluster, namespace, job)
        network = wait_for(f"{name} network resolved", lambda: get_job(cluster, namespace, name).get("status", {}).get("network"),
                           60, failed=operator.check)
        seen = wait_for(f"an Event about {name}'s network", lambda: [
            e for e in events(cluster, namespace, name) if "tcp" in e["message"] and RDMA in e["message"]], 30,
            failed=operator.check)
        created = wait_for(f"pods of {name}", lambda: job_pods(cluster, namespace, name) or None, 60, failed=operator.check)
    assert network["mode"] == "tcp" and RDMA in network["reason"], network
    assert seen[0]["type"] == "Normal"
    for pod in created.values():
        if pod["metadata"]["labels"][LABEL_ROLE] != CONTROLLER:
            assert env_of(pod)["NCCL_IB_DISABLE"] == "1"
        assert RDMA not in pod["spec"]["containers"][0].get("resources", {}).get("requests", {})


# ---------------------------------------------------------------------------------- one namespace


def test_a_namespaced_install_runs_jobs_in_its_namespace_only(cluster, helm, operator_from_chart):
    release, ops = f"ws-{uuid.uuid4().hex[:6]}", new_namespace(cluster, "ops")
    watched, other = new_namespace(cluster, "team"), new_namespace(cluster, "other")
    job = example("rdma-job.yaml")
    job["metadata"]["name"] = "scoped"
    job["spec"]["network"]["mode"] = "tcp"
    try:
        install(helm, release, ops, f"watchNamespaces={{{watched}}}")
        with operator_from_chart(ops, release) as operator:
            apply(cluster, other, job)
            apply(cluster, watched, job)
            wait_for(f"{job['metadata']['name']} in {watched} has its pods", lambda: len(job_pods(cluster, watched, "scoped"))
                     == load_job(job).layout.pods, 60, failed=operator.check)
            wait_for("scoped has ChildrenCreated", lambda: any(
                c["type"] == "ChildrenCreated" and c["status"] == "True"
                for c in get_job(cluster, watched, "scoped").get("status", {}).get("conditions", [])), 30,
                failed=operator.check)
            # The job outside the watched namespace was handled by nobody.
            assert "status" not in get_job(cluster, other, "scoped")
            assert not job_pods(cluster, other, "scoped")
    finally:
        helm("uninstall", release, "--namespace", ops, "--ignore-not-found", "--wait", check=False)
        cluster.delete_namespaces(ops, watched, other)
