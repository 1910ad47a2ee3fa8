"""The `weightsync` command as a user runs it, and the example job with changes.

`weightsync()` runs the command in a process of its own, as a user does; `in_process()` calls its
`main` in the test's own process, with the same environment, arguments and answer, for the many
cases that refuse bad input or print and return (no interpreter to start and no torch to import
again for each: a few seconds a case on two cores)."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


EXAMPLE = ROOT / "examples" / "tcp-job.yaml"
_ABSENT = object()


def _environment(env: dict | None) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")}
    return {**base, **(env or {})}


def weightsync(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True,
                          env=_environment(env), timeout=timeout)


def in_process(*args, env=None) -> subprocess.CompletedProcess:
    """`weightsync ARGS` answered by weightsync.cli.main in this process, under the environment
    the command would have (os.environ put back after), as a CompletedProcess of its exit code,
    stdout and stderr."""
    from weightsync.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved, triton = dict(os.environ), sys.modules.get("triton", _ABSENT)  # bench hides triton (runtime/rank.py)
    os.environ.clear()
    os.environ.update(_environment(env))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's --version, --help and usage errors; sys.exit(message)
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, (int, type(None))):  # as the interpreter does on its way out
                    print(e.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if triton is _ABSENT:
            sys.modules.pop("triton", None)
        else:
            sys.modules["triton"] = triton
    return subprocess.CompletedProcess(["weightsync", *args], code, out.getvalue(), err.getvalue())


def children() -> set[int]:
    """The live processes this process started (what a command run in_process would have started)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[1]) == os.getpid():
                found.add(int(entry.name))
    return found


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
