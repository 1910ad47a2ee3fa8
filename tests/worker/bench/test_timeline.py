"""`weightsync report`: a job's versions drawn from its controller's log, as a local run leaves it
(`weightsync run --logs`), and clear refusals where there is nothing to draw."""

import subprocess

import pytest

from support.cli import in_process
from support.jobs import make_job, run_to_end

PNG = b"\x89PNG\r\n\x1a\n"


def report(*args: str) -> subprocess.CompletedProcess:
    return in_process("report", *args)


def test_nothing_to_draw_is_said_in_one_line(tmp_path):
    out = report(str(tmp_path))
    assert out.returncode != 0 and "no controller log (*-controller-0.log)" in out.stderr, out.stderr
    log = tmp_path / "demo-controller-0.log"
    log.write_text("waiting for the ranks to join\n")
    out = report(str(log), "--out", str(tmp_path / "t.png"))
    assert out.returncode == 1 and "records no delivered version" in out.stderr, out.stderr
    out = report(str(log), "--out", str(tmp_path / "t.svg"))
    assert out.returncode == 2 and "does not end in .png" in out.stderr, out.stderr


@pytest.mark.slow  # a whole local job
def test_a_local_runs_versions_as_a_timeline(tmp_path):
    job = make_job("timeline", steps=4, every=2)
    summary, transfers = run_to_end(tmp_path, job)
    png = tmp_path / "timeline.png"
    out = report(str(tmp_path / "run"), "--out", str(png))
    assert out.returncode == 0, out.stderr
    assert f"{len(transfers)} versions from" in out.stdout and len(transfers) >= summary["versions"] == 3
    data = png.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
