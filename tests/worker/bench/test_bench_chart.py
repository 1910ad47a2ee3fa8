"""`weightsync bench --chart`: the report drawn as a PNG beside the table or JSON it prints, and
--chart refused before anything runs where it cannot be honoured."""

import json
import subprocess
import sys

import pytest

PNG = b"\x89PNG\r\n\x1a\n"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightsync.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("args,problem", [
    (("--chart", "report.svg"), "'report.svg' does not end in .png"),
    (("--chart", "/no/such/folder/report.png"), "the folder /no/such/folder does not exist"),
    (("--fsdp", "--chart", "report.png"), "draws the transfer benchmark (loopback or --links), not --vllm or --fsdp"),
])
def test_a_chart_that_cannot_be_drawn_is_refused_before_the_run(args, problem):
    out = bench(*args)
    assert out.returncode == 2 and f"--chart: {problem}" in out.stderr, out.stderr


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
