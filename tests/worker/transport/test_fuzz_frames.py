"""The fuzz pass over the data port's parsing (fuzz_frames.py), with a bounded budget: fuzzer
inputs against a real listening receiver for about 25 seconds from a fixed seed. Any crash (an
exception other than the transport's own, a hang, memory growing by more than 512 MiB) fails the test with
the fuzzer's report and the input that caused it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("fuzz_frames.py")
SECONDS = 25


@pytest.mark.slow  # a fuzz pass of SECONDS: not in `make unit`
def test_fuzzing_the_frame_parser_finds_no_crash(tmp_path):
    try:
        import atheris  # noqa: F401
    except ImportError as e:
        pytest.skip(f"atheris is not installed (pip install 'atheris>=3.0', in the dev extra): {e}")
    corpus = tmp_path / "corpus"
    worker = Path(__file__).resolve().parents[3] / "worker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worker), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(HARNESS), f"-max_total_time={SECONDS}", "-runs=10000000", "-seed=1",
           "--rss-growth-mb", "512", "-max_len=4096", "-timeout=60", f"-artifact_prefix={tmp_path}/",
           "--seeds-into", str(corpus), str(corpus)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SECONDS + 300)
    out = run.stdout + run.stderr
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-", "leak-")))
    assert run.returncode == 0 and not crashes, f"the fuzzer found a crash ({crashes}):\n{out[-6000:]}"
    done = [line for line in out.splitlines() if line.startswith("Done ")]
    assert done, out[-3000:]
    print(done[0])
    # every kind of outcome was reached: a valid version accepted, frames refused after the
    # handshake, input refused before it
    for outcome in ("accepted", "refused", "refused before the handshake"):
        assert f"fuzz_frames: first input {outcome}\n" in out, out[-3000:]
