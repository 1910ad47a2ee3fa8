"""`weightsync bench --scrape SECONDS`: does a Prometheus that scrapes a job slow its versions?

The --fsdp bench's DDP job (GPT-2 124M, trainer ranks publishing back to back through the trainer
API, `weightsync run`'s local processes), run four times in the order quiet, scraped, scraped,
quiet (so that the machine's drift weighs on both alike). Scraped, a thread reads every pod's
/metrics and the controller's every SECONDS, as Prometheus does: one GET each, the whole text
parsed. Prometheus scrapes every 15 s by default (the chart's scrape config every 15 s too), so
0.1 s is 150 times the rate anyone runs. A version's time is the controller's, from its go to the
last inference rank holding it verified; the first version is left out.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from weightsync.bench.fsdp import run_wrap
from weightsync.job import Env
from weightsync.runtime.health import METRICS_PATH

ORDER = ("quiet", "scraped", "scraped", "quiet")
SCRAPE_TIMEOUT = 10.0


def endpoints(local) -> list[str]:
    """What a Prometheus scrapes of a local job: every pod's /metrics, the controller's included."""
    return [f"http://127.0.0.1:{pod.env[Env.HEALTH_PORT]}{METRICS_PATH}" for pod in local.pods]


class Scraper:
    """Each of `urls` read and parsed every `every` seconds while it runs."""

    def __init__(self, urls: list[str], every: float):
        self.urls, self.every, self.scrapes, self.failed = urls, every, 0, 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            began = time.monotonic()
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as response:
                        for _ in text_string_to_metric_families(response.read().decode()):
                            pass
                    self.scrapes += 1
                except OSError:  # a pod between starts, or gone at the end: counted, as Prometheus's up == 0
                    self.failed += 1
            self.stopping.wait(max(0.0, self.every - (time.monotonic() - began)))

    @contextlib.contextmanager
    def running(self):
        self.thread.start()
        try:
            yield self
        finally:
            self.stopping.set()
            self.thread.join()


def run(every: float, trainers: int, inferences: int, versions: int, bucket_mb: int) -> dict:
    seconds: dict[str, list[float]] = {"quiet": [], "scraped": []}
    scrapers: list[Scraper] = []

    def scraped(local):
        scrapers.append(Scraper(endpoints(local), every))
        return scrapers[-1].running()

    for mode in ORDER:
        print(f"bench: {mode} job, {trainers}->{inferences} ...", file=sys.stderr, flush=True)
        around = scraped if mode == "scraped" else contextlib.nullcontext
        seconds[mode] += run_wrap("ddp", "bfloat16", trainers, inferences, versions, bucket_mb, around)["seconds"]
    quiet, loud = statistics.median(seconds["quiet"]), statistics.median(seconds["scraped"])
    return {"model": "GPT-2 (GPT2Config defaults), bfloat16, DDP trainer ranks", "trainers": trainers,
            "inferences": inferences, "scrape_every": every, "endpoints": len(scrapers[0].urls),
            "scrapes": sum(s.scrapes for s in scrapers), "failed_scrapes": sum(s.failed for s in scrapers),
            "quiet_seconds_per_version": quiet, "scraped_seconds_per_version": loud, "ratio": loud / quiet,
            "seconds": {k: [round(x, 4) for x in v] for k, v in seconds.items()}}


def table(report: dict) -> str:
    return "\n".join([
        f"weightsync bench --scrape {report['scrape_every']}: {report['model']}, {report['trainers']} trainer ranks -> "
        f"{report['inferences']} inference ranks; jobs {', '.join(ORDER)}",
        f"{'':<10}{'s/version (median)':>20}{'versions':>10}",
        f"{'quiet':<10}{report['quiet_seconds_per_version']:>20.3f}{len(report['seconds']['quiet']):>10}",
        f"{'scraped':<10}{report['scraped_seconds_per_version']:>20.3f}{len(report['seconds']['scraped']):>10}",
        f"scraped / quiet: {report['ratio']:.3f}; {report['scrapes']} scrapes of {report['endpoints']} endpoints "
        f"({report['failed_scrapes']} found a pod between starts or gone)"])


def main(every: float, trainers: int, inferences: int, versions: int, bucket_mb: int, as_json: bool) -> int:
    report = run(every, trainers, inferences, versions, bucket_mb)
    print(json.dumps(report, indent=2) if as_json else table(report), flush=True)
    return 0
