"""A whole local job's metrics, scraped as Prometheus scrapes them, agree with what its controller
reports: the controller holds at its "delivered" pause point (runtime/faults.py) once the last
version is delivered, while every pod still serves /metrics; then the job ends as usual and its
records are compared with what was scraped, the controller's and every rank's."""

from __future__ import annotations

import io
import json
import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.jobs import make_job, outcome_of

from weightsync.job import CONTROLLER, INFERENCE, TRAINER, Env
from weightsync.local.runner import STATUS_FILE, LocalJob
from weightsync.runtime.faults import PAUSE_DIR_ENV
from weightsync.runtime.metrics import RECEIVER_STATES

pytestmark = pytest.mark.slow  # a whole job as processes: not in `make unit`

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[[^\]]+\] ")
SINCE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
REACH_TIMEOUT = 240.0  # seconds for the job to deliver its last version on a loaded machine


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, its labels): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_jobs_scraped_metrics_agree_with_its_records(tmp_path):
    # one trainer, one inference pod of two rank processes (the board's slots are written by two processes)
    job = make_job("metered", trainers=(1, 1), inferences=(1, 2), steps=4, every=2)
    pause = tmp_path / "pause"
    pause.mkdir()
    for version in range(8):  # the last version's point holds the controller; it reaches no other
        (pause / f"{CONTROLLER}-0-delivered-v{version}.arm").touch()
    progress = io.StringIO()
    local = LocalJob(job, tmp_path / "run", {PAUSE_DIR_ENV: str(pause)}, progress=progress)
    local.start()
    try:
        deadline = time.monotonic() + REACH_TIMEOUT
        while not list(pause.glob("*.reached")):
            assert time.monotonic() < deadline, f"the job delivered no last version within {REACH_TIMEOUT:.0f}s"
            assert local.kubelet.failure is None, local.kubelet.failure
            time.sleep(0.05)
        url = {p.role: f"http://127.0.0.1:{p.env[Env.HEALTH_PORT]}/metrics" for p in local.pods}
        controller, trainer, inference = scrape(local.metrics_url), scrape(url[TRAINER]), scrape(url[INFERENCE])
        for reached in pause.glob("*.reached"):
            (pause / reached.name.replace(".reached", ".release")).touch()
    finally:
        outcome = outcome_of(local, REACH_TIMEOUT)
    assert isinstance(outcome, dict), outcome
    assert f"the controller's metrics for Prometheus: {local.metrics_url}\n" in progress.getvalue()
    assert local.metrics_url == url[CONTROLLER]

    transfers = local.transfers
    final = transfers[-1]["version"]
    assert controller[("weightsync_versions_delivered_total", ())] == outcome["versions"] == final + 1
    assert controller[("weightsync_version", ())] == final
    assert controller[("weightsync_delivered_bytes_total", ())] == sum(t["bytes"] for t in transfers)
    assert controller[("weightsync_wire_bytes_total", ())] == sum(t["wireBytes"] for t in transfers)
    assert controller[("weightsync_version_seconds_count", ())] == len(transfers)
    assert controller[("weightsync_version_seconds_sum", ())] == pytest.approx(sum(t["seconds"] for t in transfers),
                                                                               abs=1e-3)
    assert controller[("weightsync_publish_to_serving_seconds_count", ())] == len(transfers)
    assert controller[("weightsync_receivers", (("state", "current"),))] == 2
    assert controller[("weightsync_receivers", (("state", "away"),))] == 0
    assert controller[("weightsync_rejoins_total", ())] == 0
    assert controller[("weightsync_vllm_stall_seconds_count", ())] == 0  # the built-in engine stalls nothing

    assert trainer[("weightsync_sent_bytes_total", (("rank", "0"),))] == sum(t["wireBytes"] for t in transfers)
    for rank in ("0", "1"):
        assert inference[("weightsync_received_bytes_total", (("rank", rank),))] == \
            sum(t["version_bytes"] for t in transfers)
        assert inference[("weightsync_checksum_failures_total", (("rank", rank),))] == 0
        assert inference[("weightsync_serving_version", (("rank", rank),))] == final

    # the status tells the same story: every inference rank current on the final version
    receivers = json.loads((local.workdir / STATUS_FILE).read_text())["receivers"]
    assert (receivers["total"], receivers["ready"], receivers["version"]) == (2, "2/2", final)
    assert {s: receivers[s] for s in RECEIVER_STATES} == \
        {s: controller[("weightsync_receivers", (("state", s),))] for s in RECEIVER_STATES}
    assert [(r["rank"], r["state"], r["version"]) for r in receivers["ranks"]] == [(0, "current", final),
                                                                                   (1, "current", final)]
    (pod,) = [p.name for p in local.pods if p.role == INFERENCE]
    assert all(r["pod"] == pod and SINCE.match(r["since"]) for r in receivers["ranks"]), receivers["ranks"]

    # every pod's log line says when and who (the controller's records on stdout are JSON objects,
    # each with its time); an inference rank says what a version generates once
    for pod in local.pods:
        lines = [x for x in pod.log.read_text().splitlines() if x and not x.startswith("{")]
        assert lines and all(LINE.match(x) for x in lines), [x for x in lines if not LINE.match(x)]
        if pod.role == INFERENCE:
            said = [x.split(" generates")[0].split(" ", 1)[1] for x in lines if " generates " in x]  # [who] version v
            assert said and len(said) == len(set(said)), said
