"""Every test and bench hook, in one place: the points where the product's code lets a test hold
a rank, see its weights, corrupt its bytes, or a benchmark quiet its engines. Nothing happens
unless the hook's environment variable is set, which a job cannot do (the CRD refuses WEIGHTSYNC_*
in spec.trainer.env, and `weightsync run` keeps the shell's from its pods): a test or benchmark
sets it in its own processes or through LocalJob's extra environment.

  PAUSE_DIR_ENV  pause_point(): a rank holds at a named point of a version while the test kills
                 or stops whatever process it wants (tests/worker/runtime/test_faults.py,
                 tests/worker/local/test_join_faults.py, tests/worker/local/test_runner_metrics.py,
                 tests/worker/rendezvous/test_rendezvous_attacks.py,
                 tests/worker/vllm_backend/test_vllm_engine.py).
  DUMP_DIR_ENV   dumping(), dump(): trainer and inference ranks save every version's tensors and
                 logits, so that a test compares real weights and logits (tests/support/jobs.py,
                 and with it the runner, fault, restart, delta, TP and GPU job tests;
                 tests/worker/publisher/test_trainer_api.py,
                 tests/worker/vllm_backend/test_vllm_engine.py).
  CORRUPT_ENV    tamper_hook(): trainer ranks flip a byte of a version after hashing it, as a bad
                 link would ("V": the first byte a rank sends of version V; "V@B": the version's
                 byte B) (tests/worker/transport/test_transport_p2p.py through
                 tests/support/transfer_peer.py, tests/worker/vllm_backend/test_vllm_engine.py,
                 tests/worker/local/test_quantized_job.py).
  FAIL_LOAD_ENV  load_fails(), failing_half(): an inference rank's engine fails its load of a
                 version after half of the model's layers, as a load that fails part-way would
                 (tests/worker/local/test_load_failure.py, tests/worker/vllm_backend/test_vllm_tp.py,
                 tests/worker/vllm_backend/test_load_ahead.py through tests/support/ahead_probe.py).
  IDLE_ENV       generating(): the built-in engines generate nothing between versions
                 (`weightsync bench --fsdp`, bench/fsdp.py).

Torch-free: the controller's pause point needs no torch, and dump() imports it when it runs.
"""

from __future__ import annotations

import os
import re
import time

# A directory where trainer and inference ranks save, after every version, the version's tensors
# and the logits on model.PROMPT.
DUMP_DIR_ENV = "WEIGHTSYNC_TEST_DUMP_DIR"
# A directory of armed pause points. A rank that reaches point P of version V, when the file
# <role>-<rank>-<P>-v<V>.arm is there, removes it, creates ....reached and waits (at most
# PAUSE_LIMIT seconds) for ....release: meanwhile the test kills or stops whatever process it
# wants, at a known point of a version. Points: trainer "before-ready" (its weights taken, not
# ready yet: the controller cannot announce the version), "before-go" (ready, before the go) and
# "mid-send" (its first bucket of the version handed to the transport, the others not yet: every
# inference rank is then in the middle of receiving); inference "verifying" (received, before the
# check against the reference), "joining" (v0: its start counted and its model built, before it
# joins) and, in a vLLM server, "loading" (its server paused, the update call in, before the load);
# controller "verifying" (the trainers are done, the inference ranks' digests not yet checked),
# "staged" (every vLLM server's workers hold the version verified, and with loadAhead loaded into
# their second copy; no server paused yet) and "delivered" (the last version delivered, the job
# not ended yet: its metrics are complete).
PAUSE_DIR_ENV = "WEIGHTSYNC_TEST_PAUSE_DIR"
PAUSE_LIMIT = 120.0
# seconds: another PAUSE_LIMIT, for a test that acts for longer while a rank holds (one that starts
# vLLM servers meanwhile, which takes minutes on busy cores)
PAUSE_LIMIT_ENV = "WEIGHTSYNC_TEST_PAUSE_LIMIT"
# "<version>" - trainer ranks flip one byte of the first chunk they send of that version after
# hashing it, as a bad link would: every receiver must refuse the version.
CORRUPT_ENV = "WEIGHTSYNC_TEST_CORRUPT_VERSION"
# "<rank>@<version>[,<rank>@<version>...]" - those inference ranks fail their load of that version
# after half of the model's layers (LoadFault): the first half of the layers loaded, the rest not.
FAIL_LOAD_ENV = "WEIGHTSYNC_TEST_FAIL_LOAD"
# "1" - the built-in engines switch to every verified version and generate nothing, so that a
# benchmark timing the transfer has no generation competing for the cores (a version then also
# waits for no generation to end before the model runs on it).
IDLE_ENV = "WEIGHTSYNC_BENCH_IDLE"


def pause_point(role: str, rank: int, point: str, version: int) -> None:
    """PAUSE_DIR_ENV: hold here while the test acts, if it armed this point."""
    folder = os.environ.get(PAUSE_DIR_ENV)
    if not folder:
        return
    base = os.path.join(folder, f"{role}-{rank}-{point}-v{version}")
    try:
        os.remove(base + ".arm")
    except FileNotFoundError:
        return
    open(base + ".reached", "w").close()
    deadline = time.monotonic() + float(os.environ.get(PAUSE_LIMIT_ENV) or PAUSE_LIMIT)
    while not os.path.exists(base + ".release") and time.monotonic() < deadline:
        time.sleep(0.01)


def tamper_hook():
    """CORRUPT_ENV: the VersionSender's tamper function, or None."""
    version = os.environ.get(CORRUPT_ENV)
    if not version:
        return None
    flipped: set[int] = set()

    version, _, byte = version.partition("@")

    def tamper(v: int, chunk: memoryview, at: int | None = None) -> None:
        """Flip the chunk's first byte, or with "VERSION@BYTE" the version's byte BYTE where the
        chunk holds it (`at`: the version's byte at the chunk's start, None where unknown)."""
        if v != int(version) or v in flipped or not len(chunk):
            return
        if not byte:
            chunk[0] ^= 0xFF
        elif at is not None and at <= int(byte) < at + len(chunk):
            chunk[int(byte) - at] ^= 0xFF
        else:
            return
        flipped.add(v)

    return tamper


def dumping() -> bool:
    """DUMP_DIR_ENV: whether ranks save their versions (dump())."""
    return bool(os.environ.get(DUMP_DIR_ENV))


def dump(role: str, rank: int, version: int, tensors: dict, logits, sent: dict | None = None) -> None:
    """DUMP_DIR_ENV: save this rank's tensors of a version and its logits on the prompt (and a
    trainer's of a quantized version, the tensors it sent: `sent`)."""
    import torch

    torch.save({"tensors": tensors, "logits": logits, **({"sent": sent} if sent is not None else {})},
               os.path.join(os.environ[DUMP_DIR_ENV], f"{role}-{rank}-v{version}.pt"))


def generating() -> bool:
    """Whether the built-in engines generate between versions (IDLE_ENV: not in benchmarks)."""
    return os.environ.get(IDLE_ENV) != "1"


class LoadFault(RuntimeError):
    """FAIL_LOAD_ENV's failure, raised part-way through a load."""


def load_fails(rank: int, version: int) -> bool:
    """FAIL_LOAD_ENV: whether inference rank `rank`'s load of `version` is to fail part-way."""
    armed = os.environ.get(FAIL_LOAD_ENV, "")
    return f"{rank}@{version}" in {a.strip() for a in armed.split(",")}


def half_of(names: list[str]) -> int:
    """How many of a version's tensors (checkpoint names, in order) come before the second half of
    the model's layers (the numbered blocks, `...layers.3...`, `...h.3...`): the tensors a load that
    fails after half of the layers has loaded."""
    layers = [int(m.group(1)) if (m := re.search(r"\.(\d+)\.", name)) else None for name in names]
    numbered = [n for n in layers if n is not None]
    if not numbered:
        return len(names) // 2
    half = (max(numbered) + 1 + 1) // 2  # layers 0..half-1 load
    return next((i for i, n in enumerate(layers) if n is not None and n >= half), len(names))


def failing_half(named, rank: int, version: int):
    """`named` ((name, tensor) pairs of a version, as an engine loads them), or where FAIL_LOAD_ENV
    arms this rank's load of `version` its first half of the layers, then LoadFault."""
    if not load_fails(rank, version):
        return named
    named = list(named)
    half = half_of([name for name, _ in named])

    def loading():
        yield from named[:half]
        raise LoadFault(f"the load of version {version} failed after {half} of its {len(named)} tensors (half of "
                        f"its layers; {FAIL_LOAD_ENV})")

    return loading()
