"""`weightsync report`: a job's versions drawn from its controller's log, as a local run leaves it
(`weightsync run --logs`), and clear refusals where there is nothing to draw."""

import json
import os
import subprocess
import time

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


def record(number: int, **change) -> str:
    """A controller's log line with the record of a delivered version (as roles/controller/records.py writes it)."""
    fields = {"event": "transfer", "version": number, "step": number, "bytes": 4_000_000, "wireBytes": 1_000_000,
              "seconds": 0.5 + (number % 7) / 10, "transport": "tcp", "inference_ranks": 2, "stall_seconds": 0.01}
    return f"2026-11-28T10:00:00Z [controller] {json.dumps({**fields, **change})}\n"


@pytest.mark.parametrize("line, says", [
    (record(3, seconds="fast"), "line 2: a transfer record that is not a controller's (its 'seconds' is 'fast', not a "
                                "number of 0 or more); give the log of a weightsync controller, as written"),
    (record(3, version=None), "line 2: a transfer record that is not a controller's (its 'version' is None, not a whole "
                              "number of 0 or more)"),
    (record(3, bytes=-1), "its 'bytes' is -1"),
    (record(3, inference_ranks=float("nan")), "its 'inference_ranks' is nan"),
])
def test_a_record_that_is_not_a_controllers_is_refused_in_one_line_naming_the_line(tmp_path, line, says):
    log = tmp_path / "demo-controller-0.log"
    log.write_text(record(0) + line + record(4))
    out = report(str(log), "--out", str(tmp_path / "t.png"))
    assert out.returncode == 1 and says in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "t.png").exists()


def test_lines_that_only_look_like_records_are_passed_over_and_an_unwritable_out_is_said(tmp_path):
    log = tmp_path / "demo-controller-0.log"
    deep = '{"event": ' + "[" * 100_000 + "\n"  # too deep for Python's JSON reader
    log.write_text(record(0) + deep + '{"event": "transfer"} and more\n' + record(1))
    png = tmp_path / "t.png"
    out = report(str(log), "--out", str(png))
    assert out.returncode == 0 and "2 versions from" in out.stdout and png.read_bytes().startswith(PNG), out.stderr
    out = report(str(log), "--out", str(tmp_path / "absent" / "t.png"))
    assert out.returncode == 1 and out.stderr.startswith("weightsync report: cannot write ") and \
        out.stderr.count("\n") == 1, out.stderr


def test_a_line_longer_than_any_record_is_passed_over_unheld_and_said_once(tmp_path):
    log = tmp_path / "demo-controller-0.log"
    with open(log, "w") as f:
        f.write(record(0))
        f.write('{"event": "transfer", "pad": "' + "x" * (3 << 20) + '"}\n')  # 3 MiB on one line
        f.write(record(1))
        f.write("y" * (2 << 20) + "\n")
        f.write(record(2))
    png = tmp_path / "t.png"
    out = report(str(log), "--out", str(png))
    assert out.returncode == 0 and "3 versions from" in out.stdout and png.read_bytes().startswith(PNG), out.stderr
    assert out.stderr == (f"weightsync report: {log}: passed over 2 line(s) longer than 1 MiB (the first: line 2); a "
                          "controller's records are a few hundred bytes\n")


@pytest.mark.parametrize("make, says", [
    (lambda p: os.mkfifo(p), "not a regular file (a named pipe); name a file to write"),
    (lambda p: os.symlink(p.name, p), "a loop of symbolic links; name a file to write"),
    (lambda p: p.mkdir(), "is a directory; name a file in it"),
])
def test_an_out_that_cannot_be_written_is_refused_before_the_log_is_read(tmp_path, make, says):
    """Once it said "cannot write ...: None", after reading the whole log."""
    log = tmp_path / "demo-controller-0.log"
    log.write_text(record(0) + record(1, seconds="fast"))  # read, this log would be refused for its line 2
    png = tmp_path / "t.png"
    make(png)
    out = report(str(log), "--out", str(png))
    assert (out.returncode, out.stderr) == (1, f"weightsync report: cannot write {png}: {says}\n")


def test_a_log_that_is_a_pipe_is_refused_not_waited_on(tmp_path):
    (tmp_path / "logs").mkdir()
    os.mkfifo(tmp_path / "logs" / "demo-controller-0.log")
    out = report(str(tmp_path), "--out", str(tmp_path / "t.png"))
    assert out.returncode == 1 and out.stderr == (f"weightsync report: {tmp_path}/logs/demo-controller-0.log: not a "
                                                  "regular file (a named pipe); give the path of a controller's log\n")


def test_twenty_thousand_versions_are_drawn_in_buckets(tmp_path):
    log = tmp_path / "long-controller-0.log"
    log.write_text("".join(record(v, stall_seconds=None if v % 2 else 0.01) for v in range(20_000)))
    png = tmp_path / "t.png"
    began = time.monotonic()
    out = report(str(log), "--out", str(png))
    took = time.monotonic() - began
    assert out.returncode == 0 and "20000 versions from" in out.stdout, out.stderr
    assert png.read_bytes().startswith(PNG) and took < 30, f"{took:.1f}s"


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
