"""vLLM's own log lines in the shape of every other line of a job's logs (job/logline.py): the UTC
time to the millisecond first, then the source in brackets, here "vllm", the vLLM process
(APIServer, EngineCore, a tensor-parallel worker) and its pid, then the level, vLLM's file and
line, and the message. vLLM's default lines start with the process and carry a local time without
the year, so that a pod's log would read in two shapes and sort in none.

vLLM takes a Python logging configuration from the file VLLM_LOGGING_CONFIG_PATH names; the
inference pod writes one that uses this module's formatter. A pod whose environment sets
VLLM_LOGGING_CONFIG_PATH, or turns vLLM's logging configuration off (VLLM_CONFIGURE_LOGGING=0),
keeps its own. Imports nothing of vLLM: the formatter runs in vLLM's processes, the rest in the
pod's.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Mapping

from weightsync.job.logline import line

CONFIG_PATH = "VLLM_LOGGING_CONFIG_PATH"
CONFIGURE = "VLLM_CONFIGURE_LOGGING"
LEVEL = "VLLM_LOGGING_LEVEL"


class VllmFormatter(logging.Formatter):
    """A vLLM log record as a job's log line (the process name is the one vLLM gives its records)."""

    def format(self, record: logging.LogRecord) -> str:
        process = getattr(record, "vllm_process_name", None) or record.processName
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return line(f"vllm {process} pid={record.process}",
                    f"{record.levelname} [{record.filename}:{record.lineno}] {message}", at=record.created)


def logging_config(level: str) -> dict:
    """vLLM's logging configuration with this module's formatter, at `level` (vLLM's default INFO)."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"weightsync": {"()": f"{__name__}.VllmFormatter"}},
            "handlers": {"weightsync": {"class": "logging.StreamHandler", "formatter": "weightsync",
                                        "level": level, "stream": "ext://sys.stdout"}},
            "loggers": {"vllm": {"handlers": ["weightsync"], "level": level, "propagate": False}}}


def logging_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a server's environment needs for its lines to have the job's shape (a configuration
    file written here), or nothing where the pod's environment configures vLLM's logging itself."""
    if CONFIG_PATH in environ or environ.get(CONFIGURE) == "0":
        return {}
    fd, path = tempfile.mkstemp(prefix="weightsync-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(logging_config(environ.get(LEVEL, "INFO").upper()), f)
    return {CONFIG_PATH: path}
