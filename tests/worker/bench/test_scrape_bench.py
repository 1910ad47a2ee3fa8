"""`weightsync bench --scrape SECONDS`: a job timed quiet and while every pod's /metrics is read
every SECONDS. The scraper reads and parses real endpoints (a prometheus_client server here) and
counts what it could not reach; the mode's arguments are refused before anything runs where they
cannot be honoured; and one small run of the real bench, its figures its own (a timing is the
bench's to report, not a test's to assert): one quiet job and one scraped, where the bench runs four
to weigh the machine's drift alike (each job starts a GPT-2 model's processes: a report made of two
proves what one made of four does)."""

import json
import socket
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server
from support.cli import in_process
from support.waits import until

from weightsync.bench import scrape
from weightsync.bench.scrape import Scraper


@pytest.mark.parametrize("args,problem", [
    (("--scrape", "0"), "--scrape: 0.0 is not a positive number of seconds"),
    (("--scrape", "0.1", "--chart", "x.png"), "--chart: --scrape prints a table only"),
    (("--scrape", "0.1", "--shapes", "2x"), "--scrape --shapes: '2x' is not one TRAINERSxINFERENCE"),
])
def test_a_scrape_bench_that_cannot_run_as_asked_is_refused_before_the_run(args, problem):
    out = in_process("bench", *args)
    assert out.returncode == 2 and problem in out.stderr, out.stderr


def test_the_scraper_reads_every_endpoint_at_its_rate_and_counts_the_ones_it_cannot_reach():
    registry = CollectorRegistry()
    Counter("weightsync_probe", "a counter to scrape", registry=registry).inc()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    try:
        scraper = Scraper([f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{closed}/metrics"], 0.05)
        began = time.monotonic()
        with scraper.running():
            until("five rounds of scrapes", lambda: scraper.scrapes >= 5, 60)
        took = time.monotonic() - began
    finally:
        server.shutdown()
        thread.join()
    # a round every 0.05 s at most, however long a busy machine took for five
    assert 5 <= scraper.scrapes <= took / 0.05 + 2, (scraper.scrapes, took)
    assert abs(scraper.failed - scraper.scrapes) <= 1, (scraper.failed, scraper.scrapes)  # one of each a round


@pytest.mark.slow  # two GPT-2 jobs as processes (about a minute on 2 cores)
def test_the_scrape_bench_times_quiet_and_scraped_jobs(monkeypatch):
    monkeypatch.setattr(scrape, "ORDER", ("quiet", "scraped"))  # the bench's four jobs: two of each kind
    out = in_process("bench", "--scrape", "0.1", "--shapes", "1x1", "--versions", "2", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["endpoints"] == 3  # the controller, a trainer pod and an inference pod
    assert len(report["seconds"]["quiet"]) == 2 and len(report["seconds"]["scraped"]) == 2  # 2 timed versions a job
    assert report["scrapes"] > 0
    assert report["ratio"] == report["scraped_seconds_per_version"] / report["quiet_seconds_per_version"]
