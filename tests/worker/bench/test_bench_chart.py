"""`weightsync bench --chart`: the report drawn as a PNG beside the table or JSON it prints (in
each mode: the transfer benchmark, --vllm and --fsdp), and --chart refused before anything runs
where it cannot be honoured. The --vllm and --fsdp pictures are drawn here from reports their own
functions put together: those benchmarks take minutes, and their figures are theirs to measure."""

import json
import os
import subprocess
import sys
import time

import pytest
from support.cli import in_process

from weightsync.bench.chart import fsdp_chart, vllm_chart
from weightsync.bench.fsdp import pooled
from weightsync.bench.vllm import PHASES, medians, version_row

PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightsync.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("args,problem", [
    (("--chart", "report.svg"), "'report.svg' does not end in .png"),
    (("--chart", "/no/such/folder/report.png"),
     "cannot write /no/such/folder/report.png: the folder /no/such/folder does not exist"),
    (("--fsdp", "--chart", "/no/such/folder/report.png"),
     "cannot write /no/such/folder/report.png: the folder /no/such/folder does not exist"),
    (("--chart", "{tmp}/loop.png"), "cannot write {tmp}/loop.png: a loop of symbolic links; name a file to write"),
    (("--vllm", sys.executable, "--chart", "{tmp}/loop.png"), "cannot write {tmp}/loop.png: a loop of symbolic links"),
    (("--chart", "{tmp}/pipe.png"), "cannot write {tmp}/pipe.png: not a regular file (a named pipe)"),
    (("--chart", "{tmp}/folder.png"), "cannot write {tmp}/folder.png: is a directory; name a file in it"),
])
def test_a_chart_that_cannot_be_drawn_is_refused_before_the_run(tmp_path, args, problem):
    os.symlink("loop.png", tmp_path / "loop.png")  # a link to itself: once found only after the whole run
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.png").mkdir()
    began = time.monotonic()
    out = in_process("bench", *(a.format(tmp=tmp_path) for a in args))
    assert out.returncode == 2 and out.stderr.startswith(f"weightsync bench: --chart: {problem.format(tmp=tmp_path)}")
    assert out.stderr.count("\n") == 1, out.stderr
    assert time.monotonic() - began < 10, "the benchmark ran before --chart was checked"


@pytest.mark.slow  # a real transfer benchmark (about 40 s on 2 cores)
def test_the_bench_draws_what_it_measured(tmp_path):
    png = tmp_path / "bench.png"
    out = bench("--shapes", "1x1", "--dtypes", "bfloat16", "--versions", "1", "--json", "--chart", str(png))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [(c["trainers"], c["inferences"]) for c in report["cases"]] == [(1, 1)]
    assert f"bench: chart in {png}" in out.stderr and "leaked" not in out.stderr
    data = png.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > height > 300  # one panel, landscape


def test_the_vllm_bench_draws_where_a_versions_seconds_go_against_the_disk_reload(tmp_path):
    rows = [version_row({"event": "transfer", "version": v, "bytes": 200, "seconds": 0.4, "stall_seconds": 0.15,
                         "phases": {"transfer": 0.1, "verify": 0.001, "staging": 0.002, "pause": 0.03, "start": 0.005,
                                    "update": 0.12, "finish": 0.004, "resume": 0.002, "stall": 0.15, "load": 0.11,
                                    "applied": 0.001}}) for v in range(1, 4)]
    ours = {"seconds_per_version": 0.4, "stall_seconds": 0.15, "bytes_per_version": 2e8, "speedup_over_disk": 0.6,
            "phases": medians([r["phases"] for r in rows])}
    disk = {"seconds_per_version": 0.24, "stall_seconds": 0.09, "bytes_per_version": 2e8, "speedup_over_disk": 1.0,
            "phases": {"save": 0.12, "pause": 0.03, "reload": 0.08, "version": 0.003, "resume": 0.003, "load": 0.08,
                       "stall": 0.09, "total": 0.24}}
    report = {"model": "Llama", "trainers": 2, "servers": 2, "methods": {"weightsync": ours, "disk": disk}}
    width, height = png_size(vllm_chart(report, list(PHASES), tmp_path / "vllm.png"))
    assert width > height > 300


def test_the_fsdp_bench_draws_seconds_and_each_trainer_ranks_memory(tmp_path):
    mib = 1 << 20

    def run(held: int, peak: int) -> dict:
        ranks = [{"rank": r, "held_bytes": held * mib, "buffer_bytes": 64 * mib, "start_rss": 300 * mib,
                  "model_rss": 800 * mib, "peak_rss": (300 + peak) * mib} for r in range(2)]
        return {"seconds": [0.5, 0.6], "send_seconds": [0.2, 0.3], "bytes_per_version": 250e6, "ranks": ranks}

    cases = [{"dtype": d, "trainers": 2, "inferences": 1,
              "methods": {"ddp": pooled([run(475, 700)]), "fsdp": pooled([run(238, 280)])}} for d in ("bfloat16", "float32")]
    report = {"model": "GPT-2", "versions": 3, "bucket_mb": 64, "cases": cases, "targets": []}
    width, height = png_size(fsdp_chart(report, tmp_path / "fsdp.png"))
    assert width > height > 300
