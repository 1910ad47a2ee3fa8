"""The pods' metrics (weightsync.runtime.metrics), scraped from a real health endpoint and parsed as
Prometheus parses them: every metric's name and type pinned; a controller's figures as it counts
them; a rank pod's board written by its rank processes, spawned as roles.supervise spawns them and
started as a vLLM server or a training command starts theirs; a taken port refused in one line."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from support.health import worker_env

from weightsync.job import Env, reasons
from weightsync.runtime import health, metrics
from weightsync_operator.metrics import OperatorMetrics

# Every metric a pod serves, and its type (the names as Prometheus stores them, without _total).
CONTROLLER = {
    "weightsync_versions_delivered": "counter",
    "weightsync_version_seconds": "histogram",
    "weightsync_delivered_bytes": "counter",
    "weightsync_wire_bytes": "counter",
    "weightsync_version": "gauge",
    "weightsync_receivers": "gauge",
    "weightsync_rejoins": "counter",
    "weightsync_failures": "counter",
    "weightsync_vllm_stall_seconds": "histogram",
    "weightsync_publish_to_serving_seconds": "histogram",
}
TRAINER_RANKS = {"weightsync_sent_bytes": "counter"}
INFERENCE_RANKS = {"weightsync_received_bytes": "counter", "weightsync_checksum_failures": "counter",
                   "weightsync_serving_version": "gauge"}


def exposed(types: dict) -> dict:
    """What the text format shows of `types`: each counter and histogram also as the gauge of when
    it was created (prometheus_client's <name>_created), which weightsync leaves as the library
    makes it rather than switch it off for every registry of the process (vLLM's too)."""
    return {**types, **{f"{name}_created": "gauge" for name, kind in types.items() if kind != "gauge"}}


def scrape(registry) -> tuple[dict, str]:
    """Serve `registry` as a pod does and scrape it: ({name: family}, content type)."""
    pod = health.PodHealth(["controller"])
    pod.serve("127.0.0.1", 0, registry)
    try:
        port = pod.server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{health.METRICS_PATH}", timeout=30) as response:
            text, kind = response.read().decode(), response.headers["Content-Type"]
    finally:
        pod.close()
    return {f.name: f for f in text_string_to_metric_families(text)}, kind


def sample(families: dict, name: str, suffix: str = "", **labels) -> float:
    found = [s.value for s in families[name].samples if s.name == name + suffix and s.labels == labels]
    assert len(found) == 1, f"{name}{suffix} {labels}: {families[name].samples}"
    return found[0]


def test_the_controller_serves_every_metric_with_its_type_and_counts_what_it_is_told():
    m = metrics.ControllerMetrics()
    m.delivered(0)
    m.round(1000, 1000, 0.5, None)
    m.delivered(1)
    m.round(1000, 300, 0.25, 0.02)
    m.round(500, 500, 0.1, 0.01)  # the final version again, to a rank that rejoined
    m.states({metrics.CURRENT: 3, metrics.AWAY: 1})
    m.rejoins.inc()
    m.failures.labels(reasons.RANK_LOST).inc()
    m.publish_to_serving.observe(0.7)
    families, kind = scrape(m.registry)
    assert kind == metrics.CONTENT_TYPE_LATEST
    assert {name: f.type for name, f in families.items()} == exposed(CONTROLLER)
    assert sample(families, "weightsync_versions_delivered", "_total") == 2
    assert sample(families, "weightsync_version") == 1
    assert sample(families, "weightsync_delivered_bytes", "_total") == 2500
    assert sample(families, "weightsync_wire_bytes", "_total") == 1800
    assert sample(families, "weightsync_version_seconds", "_count") == 3
    assert sample(families, "weightsync_version_seconds", "_sum") == pytest.approx(0.85)
    assert sample(families, "weightsync_vllm_stall_seconds", "_count") == 2
    assert sample(families, "weightsync_publish_to_serving_seconds", "_count") == 1
    assert {s.labels["state"]: s.value for s in families["weightsync_receivers"].samples} == \
        {"current": 3, "behind": 0, "away": 1, "rejoining": 0, "dropped": 0}
    assert sample(families, "weightsync_rejoins", "_total") == 1
    assert sample(families, "weightsync_failures", "_total", reason=reasons.RANK_LOST) == 1


def write_counts(rank: int, sent: int, received: int, failures: int, version: int | None) -> None:
    """A rank process's counts, into its pod's board (found through the environment)."""
    counters = metrics.rank_counters(rank)
    counters.sent(sent)
    counters.received(received)
    for _ in range(failures):
        counters.checksum_failed()
    if version is not None:
        counters.serving(version)


@pytest.mark.slow  # rank processes of a pod: not in `make unit`
@pytest.mark.parametrize("role", ["trainer", "inference"])
def test_a_rank_pods_board_shows_what_its_rank_processes_count(role):
    board = metrics.RankBoard(role, [4, 5])
    try:
        # rank 4 as roles.supervise starts a rank; rank 5 as a vLLM server or a training command starts one
        spawn = multiprocessing.get_context("spawn")
        child = spawn.Process(target=write_counts, args=(4, 100, 200, 1, 7))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        script = "from weightsync.runtime.metrics import rank_counters as c; c(5).sent(10); c(5).sent(5); c(5).received(9)"
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=dict(os.environ))
        families, _ = scrape(board.registry)
    finally:
        board.close()
    if role == "trainer":
        assert {name: f.type for name, f in families.items()} == TRAINER_RANKS
        assert sample(families, "weightsync_sent_bytes", "_total", rank="4") == 100
        assert sample(families, "weightsync_sent_bytes", "_total", rank="5") == 15
        return
    assert {name: f.type for name, f in families.items()} == INFERENCE_RANKS
    assert sample(families, "weightsync_received_bytes", "_total", rank="4") == 200
    assert sample(families, "weightsync_received_bytes", "_total", rank="5") == 9
    assert sample(families, "weightsync_checksum_failures", "_total", rank="4") == 1
    assert sample(families, "weightsync_checksum_failures", "_total", rank="5") == 0
    assert sample(families, "weightsync_serving_version", rank="4") == 7
    assert [s.labels for s in families["weightsync_serving_version"].samples] == [{"rank": "4"}]  # 5 serves none yet
    assert metrics.BOARD_ENV not in os.environ


def test_a_rank_the_board_does_not_hold_is_refused():
    board = metrics.RankBoard("inference", [0])
    try:
        script = "from weightsync.runtime.metrics import rank_counters; rank_counters(3)"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ))
    finally:
        board.close()
    assert done.returncode != 0
    assert "ValueError: this pod's metrics board holds ranks [0], not rank 3" in done.stderr


def test_a_taken_port_is_refused_in_one_line():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError) as raised:
            health.PodHealth(["controller"]).serve("127.0.0.1", port, metrics.ControllerMetrics().registry)
    finally:
        taken.close()
    assert str(raised.value) == (f"[Errno 98] the health and metrics endpoint cannot listen on 127.0.0.1:{port}: "
                                 "Address already in use (another process holds the port)")


class Large:
    """A collector whose exposition is far larger than a socket's buffer."""

    def collect(self):
        family = GaugeMetricFamily("weightsync_test_large", "many samples", labels=["rank"])
        for rank in range(100_000):
            family.add_metric([str(rank)], rank)
        yield family


def test_an_answer_larger_than_the_sockets_buffer_arrives_whole_and_probes_still_answer():
    registry = CollectorRegistry()
    registry.register(Large())
    body, _ = metrics.exposition(registry)
    assert len(body) > 4 * 1024 * 1024
    pod = health.PodHealth(["controller"])
    # The rank beats as a rank's thread does, so that liveness asks only whether the server still
    # answers: building this answer may take longer than STALE_AFTER on a loaded machine, and a
    # rank that never stamped in that time is rightly no longer alive.
    rank, stop = pod.rank(0), threading.Event()

    def beat_until_stopped():
        while not stop.wait(health.BEAT):
            rank.stamp()

    beat = threading.Thread(target=beat_until_stopped)
    beat.start()
    pod.serve("127.0.0.1", 0, registry)
    try:
        port = pod.server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{health.METRICS_PATH}", timeout=30) as response:
            assert response.read() == body
        alive, why = health.probe("127.0.0.1", port, health.LIVENESS)
        assert alive, why
    finally:
        stop.set()
        beat.join()
        pod.close()


def test_a_worker_pod_whose_health_port_is_taken_fails_in_one_line(tmp_path):
    env = worker_env(tmp_path, 0)  # the controller's pod
    port = int(env[Env.HEALTH_PORT])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        done = subprocess.run([sys.executable, "-m", "weightsync.cli", "worker"], env=env, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[weightsync worker\] " + re.escape(
        f"the health and metrics endpoint cannot listen on 127.0.0.1:{port}: "
        "Address already in use (another process holds the port)\n"), done.stderr), done.stderr


def test_a_scrape_is_noted_so_that_a_stopping_pod_can_wait_for_one_of_its_final_figures():
    """rank.linger waits, as a scraped pod stops after its job's end, for one more read of /metrics."""
    before = time.monotonic()
    assert not health.SCRAPES.since(before, 0)
    probes = health.PodHealth(["controller"])
    probes.serve("127.0.0.1", 0, metrics.ControllerMetrics().registry)
    try:
        port = probes.server.server_address[1]
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30).close()
        assert not health.SCRAPES.since(before, 0.1), "a probe is no scrape"
        counted = health.SCRAPES.count
        urllib.request.urlopen(f"http://127.0.0.1:{port}{health.METRICS_PATH}", timeout=30).close()
        assert health.SCRAPES.since(before, 5) and health.SCRAPES.count == counted + 1

        # stopping after the job's end, the pod waits for the next scrape, and only as long
        said: list[str] = []
        ended = time.monotonic()
        later = threading.Timer(0.5, lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}{health.METRICS_PATH}", timeout=30).close())
        later.start()
        health.final_scrape(ended, said.append)
        waited = time.monotonic() - ended
        assert said == [f"waiting (at most {health.FINAL_SCRAPE:.0f}s) for a scrape of this pod's final metrics"]
        assert 0.4 < waited < health.FINAL_SCRAPE, waited
        health.final_scrape(ended, said.append)  # scraped since: it goes at once
        assert len(said) == 1
    finally:
        probes.close()


def test_the_charts_dashboard_asks_only_for_metrics_that_exist_with_the_labels_they_have():
    """Every expression of charts/weightsync/dashboards/weightsync.json names a series a pod or the
    operator serves (as Prometheus stores it: a counter's _total, a histogram's _bucket, _sum and
    _count), and groups only by labels that series has or that the chart's scrape jobs add."""
    operator = {f.name: f.type for f in OperatorMetrics().registry.collect()}
    served = {**CONTROLLER, **TRAINER_RANKS, **INFERENCE_RANKS, **operator}
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    series = {name + s for name, kind in served.items() for s in suffixes[kind]}
    labels = {"namespace", "wtj", "role", "pod", "job", "instance", "le", "rank", "state", "reason", "phase"}
    dashboard = json.loads((Path(__file__).resolve().parents[3] / "charts/weightsync/dashboards/weightsync.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    asked = {name for e in exprs for name in re.findall(r"\bweightsync_[a-z_]+", e)}
    assert asked and asked <= series, sorted(asked - series)
    grouped = {label.strip() for e in exprs for group in re.findall(r"by \(([^)]*)\)", e) for label in group.split(",")}
    assert grouped and grouped <= labels, sorted(grouped - labels)
    assert {name.removesuffix("_total") for name in asked} >= {"weightsync_versions_delivered", "weightsync_receivers",
                                                              "weightsync_wire_bytes", "weightsync_delivered_bytes"}
