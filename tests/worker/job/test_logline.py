"""Every line of a job's logs starts with its UTC time to the millisecond and its source."""

from __future__ import annotations

import re
import subprocess
import sys

from weightsync.job.logline import line, stamp
from weightsync.runtime.rank import log

LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) \[([^\]]+)\] (.*)$")


def test_a_stamp_is_utc_iso_8601_to_the_millisecond():
    assert stamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert stamp(1795705445.1239) == "2026-11-26T15:04:05.123Z"


def test_a_ranks_lines_say_when_and_who(capsys):
    log("inference rank 1", "switched to version 3")
    log("controller", "transport tcp; plan:\nbucket 0\nbucket 1")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4
    parsed = [LINE.match(x) for x in lines]
    assert all(parsed), lines
    assert parsed[0].group(2, 3) == ("inference rank 1", "switched to version 3")
    assert [m.group(2) for m in parsed[1:]] == ["controller"] * 3 and parsed[3].group(3) == "bucket 1"
    assert line("x", "y", at=0.0) == "1970-01-01T00:00:00.000Z [x] y"


def test_the_libraries_log_records_take_the_same_shape():
    """As `weightsync worker` sets up Python's logging: a module's warning names the module."""
    code = ("import logging; from weightsync.job import logline; logline.configure(); "
            "logging.getLogger('weightsync.transport').warning('peer %s is slow', 3); "
            "logging.getLogger('weightsync.transport').info('not shown')")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    (only,) = err.splitlines()
    m = LINE.match(only)
    assert m and m.group(2, 3) == ("weightsync.transport", "WARNING peer 3 is slow"), err
