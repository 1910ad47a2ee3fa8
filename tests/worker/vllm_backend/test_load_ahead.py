"""Loading a version ahead (spec.inference.vllm.loadAhead, vllm_backend/ahead.py), in vLLM's own
engine: a version prepared while vLLM generates leaves what it serves untouched, and its commit
makes every tensor vLLM serves (the CPU build's repacked linear weights read back through their
kernels) the version's, version after version, committed by copies and by storage swaps in turn;
with untied and with tied embeddings (one tensor two layers share). A load ahead that fails after
half of its layers leaves what vLLM serves as it was, and the next version loads whole into the
second copy it half wrote. The probe runs in the vLLM
environment (tests/support/ahead_probe.py); the job that loads ahead end to end is in
test_vllm_engine.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from support.vllm import LLAMA, as_bytes, shards
from support.vllm import vllm_python as find_vllm_python

pytestmark = pytest.mark.slow  # vLLM's engine in a process of its own

PROBE = Path(__file__).resolve().parents[2] / "support" / "ahead_probe.py"


CONFIGS = {"untied": {**LLAMA, "tie_word_embeddings": False}, "tied-embeddings": {**LLAMA, "tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> tuple[Path, list[dict], str]:
    """One probe for both models (vLLM imported once): its folder, its rows, its output."""
    out = tmp_path_factory.mktemp("ahead")
    # -P: not the probe's folder first on the path, where support/vllm.py would shadow vllm
    done = subprocess.run([find_vllm_python(), "-P", str(PROBE), json.dumps(CONFIGS), str(out)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stdout


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_version_loaded_ahead_is_served_only_once_committed_version_after_version(name, probed):
    config, (folder, rows, stdout) = CONFIGS[name], probed
    tmp_path = folder / name
    rows = [r for r in rows if r["config"] == name]
    assert [r["version"] for r in rows] == [0, 1, 2, 3], stdout
    assert [r["swap"] for r in rows] == [False, True, False, True]  # committed by copies and by swaps, in turn
    for row in rows:
        v = row["version"]
        assert row["unchanged_after_prepare"], f"version {v}: preparing it changed what vLLM serves"
        assert row["during"] == row["before"] and row["after_prepare"] == row["before"], \
            f"version {v}: vLLM answered otherwise while it was prepared: {row}"
        want = shards(torch.load(tmp_path / f"v{v}-version.pt"), config, 1, 0)
        got = torch.load(tmp_path / f"v{v}-served.pt")
        assert sorted(got) == sorted(want), f"vLLM serves other tensors: {sorted(set(got) ^ set(want))}"
        other = [n for n in want if not torch.equal(as_bytes(got[n]), as_bytes(want[n]))]
        assert other == [], f"version {v} committed, and vLLM serves other bytes in {other}"
    # a load ahead that failed after half of its layers, before version 2: vLLM served on version 1,
    # and version 2, prepared into the spares the failed load had half written, is served whole (above)
    failed = rows[2]["failed_ahead"]
    assert failed["raised"] and "failed after" in failed["raised"] and "half of its layers" in failed["raised"], failed
    assert failed["served_unchanged"] and failed["tokens_unchanged"], f"a failed load ahead changed what vLLM serves: {failed}"
    assert all("failed_ahead" not in r for r in rows if r["version"] != 2)
    answers = [r["after"] for r in rows]
    assert len({tuple(a) for a in answers}) == len(answers), f"the greedy tokens did not change with the version: {answers}"
