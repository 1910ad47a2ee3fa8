"""A queued job's Workload and where it stands, from Kueue's Workload as stored: the operator's pure
functions of queueing.py, without a cluster (the real Kueue runs in test_kueue_cluster.py)."""

from weightsync.job import API_VERSION, KIND, ROLES, load_job
from weightsync_operator import queueing, render, status
from weightsync_operator.queueing import Admission, Placement

STAMP = "2026-01-01T00:00:00Z"


def job(spec=None):
    return load_job({
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "demo", "namespace": "team-a"},
        "spec": {"model": {"config": {"model_type": "gpt2", "n_layer": 2}}, "trainer": {"replicas": 2},
                 "inference": {"replicas": 3}, **(spec or {})}})


def templates(j):
    return {r: render.pod_template(j, r, "tcp") for r in ROLES}


def stored(conditions=(), admission=None, generation=1):
    return {"apiVersion": queueing.API_VERSION, "kind": queueing.WORKLOAD,
            "metadata": {"name": "demo-wtj", "namespace": "team-a", "generation": generation, "resourceVersion": "7"},
            "status": {"conditions": [{"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": STAMP}
                                      for t, s, r, m in conditions], **({"admission": admission} if admission else {})}}


def test_the_workload_has_one_pod_set_per_role_with_its_count_and_follows_suspend():
    j = job()
    wl = queueing.workload(j, "lq", templates(j), priority=("high", 1000))
    assert wl["metadata"]["name"] == "demo-wtj" and wl["spec"]["queueName"] == "lq"
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("controller", 1), ("trainer", 2), ("inference", 3)]
    trainer = wl["spec"]["podSets"][1]["template"]["spec"]["containers"][0]
    assert trainer["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert wl["spec"]["priority"] == 1000 and wl["spec"]["priorityClassRef"]["name"] == "high"
    assert wl["spec"]["active"] is True
    assert queueing.workload(job({"suspend": True}), "lq", templates(j))["spec"]["active"] is False
    # an external role runs no pod of the operator's: no pod set
    ext = job({"trainer": {"replicas": 2, "external": True}})
    sets = queueing.workload(ext, "lq", {r: t for r, t in templates(ext).items() if r != "trainer"})["spec"]["podSets"]
    assert [p["name"] for p in sets] == ["controller", "inference"]


def test_a_workload_is_made_again_only_while_kueue_holds_no_quota_for_it():
    j = job()
    wanted = queueing.workload(j, "lq", templates(j))
    other = queueing.workload(job({"inference": {"replicas": 1}}), "lq", templates(j))
    old = {**stored(), "metadata": {**stored()["metadata"], "annotations": other["metadata"]["annotations"]}}
    assert queueing.stale(old, wanted)
    reserved = {**stored([("QuotaReserved", "True", "QuotaReserved", "")]), "metadata": old["metadata"]}
    assert not queueing.stale(reserved, wanted)
    same = {**stored(), "metadata": {**stored()["metadata"], "annotations": wanted["metadata"]["annotations"]}}
    assert not queueing.stale(same, wanted)


def test_where_a_job_stands_in_its_queue():
    assert queueing.admission(None, {}).held
    pending = queueing.admission(stored([("QuotaReserved", "False", "Inadmissible", "LocalQueue nope doesn't exist")]), {})
    assert pending.held and not pending.evicted and pending.message == "LocalQueue nope doesn't exist"

    granted = {"clusterQueue": "cq", "podSetAssignments": [
        {"name": "controller", "flavors": {}},
        {"name": "trainer", "flavors": {"nvidia.com/gpu": "h100", "cpu": "h100"}},
        {"name": "inference", "flavors": {"nvidia.com/gpu": "spot"}}]}
    flavors = {"h100": {"nodeLabels": {"gpu": "h100"}},
               "spot": {"nodeLabels": {"pool": "spot"}, "tolerations": [{"key": "spot", "operator": "Exists"}]}}
    admitted = queueing.admission(stored([("QuotaReserved", "True", "QuotaReserved", ""),
                                          ("Admitted", "True", "Admitted", "")], granted), flavors)
    assert admitted.admitted and admitted.cluster_queue == "cq" and "ClusterQueue cq" in admitted.message
    assert admitted.placements["trainer"] == Placement({"gpu": "h100"}, ())
    assert admitted.placements["inference"] == Placement({"pool": "spot"}, ({"key": "spot", "operator": "Exists"},))
    assert admitted.placements["controller"] == Placement({}, ())

    evicted = queueing.admission(stored([("QuotaReserved", "True", "QuotaReserved", ""),
                                         ("Admitted", "True", "Admitted", ""),
                                         ("Evicted", "True", "Preempted", "Preempted to accommodate a workload")],
                                        granted), flavors)
    assert evicted.held and evicted.evicted and evicted.quota_held and "Preempted" in evicted.message
    finished = queueing.admission(stored([("Finished", "True", "Succeeded", "")]), {})
    assert finished.held


def test_an_admission_places_the_roles_pods_and_a_held_job_runs_none():
    j = job({"trainer": {"replicas": 2, "nodeSelector": {"zone": "a"},
                         "tolerations": [{"key": "gpu", "operator": "Exists"}]}})
    placed = render.statefulset(j, "trainer", "tcp", placement=Placement(
        {"gpu": "h100"}, ({"key": "spot", "operator": "Exists"},)))["spec"]["template"]["spec"]
    assert placed["nodeSelector"] == {"zone": "a", "gpu": "h100"}
    assert placed["tolerations"] == [{"key": "gpu", "operator": "Exists"}, {"key": "spot", "operator": "Exists"}]

    held = Admission(False, "LocalQueue lq doesn't exist")
    s = status.compute({}, j.layout, {}, [], queued=held, at=STAMP)
    assert s["phase"] == "Queued"
    assert {r: v["desired"] for r, v in s["replicas"].items()} == {r: 0 for r in ROLES}
    conditions = {c["type"]: c for c in s["conditions"]}
    assert conditions["Admitted"]["reason"] == "Queued" and conditions["Admitted"]["message"] == held.message
    assert conditions["Ready"]["reason"] == "Queued"
    assert status.events({}, s) == [("Normal", "Queued", held.message)]

    evicted = status.compute(s, j.layout, {}, [], queued=Admission(False, "evicted", evicted=True), at=STAMP)
    assert [e for e in status.events(s, evicted) if e[1] == "Evicted"] == [("Warning", "Evicted", "evicted")]
    running = status.compute(s, j.layout, {}, [], queued=Admission(True, "admitted by Kueue to ClusterQueue cq"), at=STAMP)
    assert running["phase"] == "Pending" and running["replicas"]["trainer"]["desired"] == 2
    # a suspended job is Suspended, whatever its queue says
    suspended = status.compute({}, j.layout, {}, [], suspended=True, queued=held, at=STAMP)
    assert suspended["phase"] == "Suspended" and "Admitted" not in {c["type"] for c in suspended["conditions"]}


def test_the_quota_of_an_evicted_workload_goes_back_and_a_finished_job_finishes_its_workload():
    wl = stored([("QuotaReserved", "True", "QuotaReserved", "reserved"), ("Admitted", "True", "Admitted", ""),
                 ("Evicted", "True", "Preempted", "Preempted to accommodate a workload")],
                {"clusterQueue": "cq", "podSetAssignments": []}, generation=3)
    patch = queueing.quota_returned(wl, "2026-01-02T00:00:00Z")
    assert patch["admission"] is None
    by_type = {c["type"]: c for c in patch["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False" and by_type["QuotaReserved"]["reason"] == "Pending"
    assert by_type["QuotaReserved"]["lastTransitionTime"] == "2026-01-02T00:00:00Z"
    assert by_type["QuotaReserved"]["observedGeneration"] == 3
    assert by_type["Admitted"]["status"] == "False"
    assert by_type["Requeued"]["status"] == "True" and by_type["Requeued"]["reason"] == "Preempted"
    assert by_type["Evicted"]["lastTransitionTime"] == STAMP  # untouched

    done = queueing.finished(wl, False, "RankLost: inference rank 1", STAMP)
    fin = {c["type"]: c for c in done["conditions"]}["Finished"]
    assert (fin["status"], fin["reason"], fin["message"]) == ("True", "Failed", "RankLost: inference rank 1")
