"""The `weightsync` command as a user runs it, and the example job with changes."""

import os
import subprocess
import sys
from pathlib import Path
import yaml


ROOT = Path(__file__).resolve().parents[2]


EXAMPLE = ROOT / "examples" / "tcp-job.yaml"


def weightsync(*args, env=None, timeout=120):
    base = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    return subprocess.run([sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=timeout)


def example(**changes) -> dict:
    """The tcp example with spec fields replaced (dotted paths; None removes the field)."""
    obj = yaml.safe_load(EXAMPLE.read_text())
    for path, value in changes.items():
        node = obj["spec"]
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return obj

