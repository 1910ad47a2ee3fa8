"""Delta versions: patches round trip bit for bit (every element size, unchanged, sparse and dense
chunks, long unchanged runs, a short last chunk); a patch against another base, or a damaged
one, is refused and never applied; a bucket where everything changed goes whole; and over real
sockets between real processes (transfer_peer.py), patched versions arrive bit for bit, a rank
whose base differs refuses the patches and gets the buckets whole in the same version, a rank
that holds nothing gets the version whole, and a version where everything changed costs the
whole version's bytes on the wire, not more."""

import json

import numpy as np
import pytest
import torch
import xxhash
from support.tiers import first_in_unit
from support.transfer_peer import layout_of, plan_of

from weightsync.model.flat import ITEMSIZE
from weightsync.plan.segments import Bucket, make_plan
from weightsync.transfer import delta
from weightsync.transfer.delta import RECORD, LastSent, Patcher, PatchError, apply_patch
from weightsync.transport.checksum import CHUNK

MIB = 1 << 20


def encode(old: np.ndarray, new: np.ndarray, itemsize: int, base_version: int = 7, threads: int = 1):
    """Keep `old` as version base_version, then encode `new` against it chunk by chunk, as a
    sender does; returns (the patch or None when the bucket went whole, the encoder, what is kept)."""
    last = LastSent([Bucket(0, 0, 0, len(old))], itemsize, threads)
    keeper = last.encoder(0, None)
    for a in range(0, len(old), CHUNK):
        keeper.add(a, old[a:a + CHUNK])
    last.version = base_version
    encoder = last.encoder(0, base_version)
    for a in range(0, len(new), CHUNK):
        encoder.add(a, new[a:a + CHUNK])
    patch = None if encoder.dense else b"".join(encoder.finish(len(new)))
    last.encoders.close()
    return patch, encoder, last.bucket(0)


def changed_copy(old: np.ndarray, itemsize: int, where, seed: int = 0) -> np.ndarray:
    """`old` with the elements at the indices `where` set to other values."""
    new = old.copy()
    elements = new.view(delta.ELEMENT[itemsize])
    g = np.random.default_rng(seed)
    values = g.integers(1, 255, size=len(where), dtype=np.uint8).astype(elements.dtype)
    elements[where] ^= values  # nonzero: every named element changes
    return new


def records(patch: bytes) -> list[int]:
    """The record kinds of a patch, chunk by chunk."""
    kinds, at = [], delta.HEAD.size
    while at < len(patch):
        kind, _, stored = RECORD.unpack_from(patch, at)
        kinds.append(kind)
        at += RECORD.size + stored
    return kinds


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_patches_round_trip_bit_for_bit(itemsize):
    g = np.random.default_rng(itemsize)
    length = 3 * MIB + 4096  # three whole chunks and a short one
    old = g.integers(0, 256, size=length, dtype=np.uint8)
    n = length // itemsize
    per_chunk = CHUNK // itemsize
    where = np.concatenate([
        g.choice(per_chunk, size=per_chunk // 50, replace=False),  # chunk 0: 2% changed, sparse
        # chunk 1: unchanged
        per_chunk * 2 + g.choice(per_chunk, size=per_chunk * 19 // 20, replace=False),  # chunk 2: dense, raw
        [n - 1],  # the short last chunk: its last element only, after a long unchanged run
    ])
    new = changed_copy(old, itemsize, np.sort(where))
    patch, encoder, kept = encode(old, new, itemsize)
    assert patch is not None and records(patch) == [delta.SPARSE, delta.SAME, delta.RAW, delta.SPARSE]
    assert len(patch) < length
    out = np.zeros(length, dtype=np.uint8)
    assert apply_patch(patch, old, out, 7) == xxhash.xxh3_64_intdigest(new)
    assert np.array_equal(out, new)
    assert np.array_equal(kept, new), "the sender must keep the new bytes for the next version"
    assert encoder.changed == len(where) and encoder.compared == n


def test_chunks_encoded_on_several_threads_make_the_same_patch():
    old = np.random.default_rng(3).integers(0, 256, size=5 * MIB + 640, dtype=np.uint8)
    n = len(old) // 2
    new = changed_copy(old, 2, np.sort(np.random.default_rng(4).choice(n, size=n // 40, replace=False)))
    one, _, _ = encode(old, new, 2)
    three, encoder, kept = encode(old, new, 2, threads=3)
    assert one == three and np.array_equal(kept, new) and encoder.changed == n // 40


def test_long_unchanged_runs_need_fillers_and_round_trip():
    """Gaps longer than a u16 counts: 2-byte elements changed only at the two ends of a chunk."""
    old = np.arange(CHUNK, dtype=np.uint32).view(np.uint8)[:CHUNK].copy()
    new = changed_copy(old, 2, np.array([0, CHUNK // 2 - 1]))
    patch, encoder, _ = encode(old, new, 2)
    out = np.empty_like(old)
    apply_patch(patch, old, out, 7)
    assert np.array_equal(out, new) and encoder.changed == 2


def test_an_unchanged_bucket_is_a_few_bytes():
    old = np.random.default_rng(0).integers(0, 256, size=2 * MIB, dtype=np.uint8)
    patch, _, _ = encode(old, old.copy(), 2)
    assert records(patch) == [delta.SAME, delta.SAME] and len(patch) == delta.HEAD.size + 2 * RECORD.size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bucket_where_everything_changed_goes_whole(dtype):
    """An optimizer step moves every float32 element: the first chunk shows it, no patch is
    made, and the new bytes are still kept."""
    torch.manual_seed(0)
    weights = torch.randn(3 * MIB // 4)
    stepped = weights - 1e-3 * torch.sign(torch.randn_like(weights))  # what AdamW's first step does
    old = weights.to(getattr(torch, dtype)).view(torch.uint8).numpy()
    new = stepped.to(getattr(torch, dtype)).view(torch.uint8).numpy()
    patch, encoder, kept = encode(old, new, ITEMSIZE[dtype])
    assert patch is None and encoder.dense
    assert np.array_equal(kept, new)
    with pytest.raises(ValueError, match="not being encoded"):
        encoder.finish(len(new))


def sparse_pair(length=2 * MIB, itemsize=2):
    old = np.random.default_rng(1).integers(0, 256, size=length, dtype=np.uint8)
    n = length // itemsize
    new = changed_copy(old, itemsize, np.sort(np.random.default_rng(2).choice(n, size=n // 30, replace=False)))
    return old, new


def test_a_patch_against_another_version_is_refused():
    old, new = sparse_pair()
    patch, _, _ = encode(old, new, 2, base_version=3)
    out = np.zeros_like(old)
    with pytest.raises(PatchError, match="against version 3; this rank holds version 4"):
        apply_patch(patch, old, out, 4)
    assert not out.any(), "nothing is written for a patch that is refused"


def test_a_patch_against_other_bytes_is_refused_by_its_checksum():
    old, new = sparse_pair()
    patch, _, _ = encode(old, new, 2)
    base = old.copy()
    base[12345] ^= 0x10  # the receiver's copy of the base differs from the sender's
    staging = torch.zeros(len(old), dtype=torch.uint8)
    patcher = Patcher(7, torch.from_numpy(base), staging)
    assert not patcher.apply(0, len(old), memoryview(patch), xxhash.xxh3_64_intdigest(new))
    assert patcher.applied == 0 and "differs from the sender's" in patcher.refused[0]
    good = Patcher(7, torch.from_numpy(old), staging)
    assert good.apply(0, len(old), memoryview(patch), xxhash.xxh3_64_intdigest(new))
    assert np.array_equal(staging.numpy(), new)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "extra"])
def test_a_damaged_patch_is_refused(damage):
    old, new = sparse_pair()
    patch = bytearray(encode(old, new, 2)[0])
    if damage == "truncated":
        patch = patch[:len(patch) // 2]
    elif damage == "flipped":
        patch[delta.HEAD.size + RECORD.size + 40] ^= 0xFF  # inside the first chunk's compressed entries
    else:
        patch += b"\0" * 8
    staging = torch.zeros(len(old), dtype=torch.uint8)
    patcher = Patcher(7, torch.from_numpy(old), staging)
    assert not patcher.apply(0, len(old), memoryview(bytes(patch)), xxhash.xxh3_64_intdigest(new))
    assert len(patcher.refused) == 1


def test_a_rank_without_a_base_refuses_every_patch():
    old, new = sparse_pair()
    patcher = Patcher(None)
    assert not patcher.apply(0, len(old), memoryview(encode(old, new, 2)[0]), 0)
    assert "holds no version" in patcher.refused[0]


# ---------------------------------------------------------------- over TCP, between processes

SHAPES = "512x256,77,300x129"  # 1.9 MiB as float32 over three tensors: buckets cut mid-tensor
BUCKET = 256 << 10


def run_versions(ranks, store, trainers, inferences, dtype, bases, *flags, change=0.02, spoil=()):  # noqa: F811
    """Trainer and inference processes send len(bases) versions; bases[v - 1] is the store's
    bases/<v>. Returns {(v, rank): result} and {(v, trainer): what it sent}."""
    versions = len(bases)
    r = ranks(trainers, inferences, SHAPES, dtype, BUCKET, versions)
    for v, named in enumerate(bases, start=1):
        store.set(f"bases/{v}", json.dumps({str(k): b for k, b in named.items()}))
    common = ["--delta", "--change", str(change), *flags]
    for i in range(inferences):
        r.start("inference", i, *common, *(["--spoil-base"] if i in spoil else []))
    for t in range(trainers):
        r.start("trainer", t, *common)
    codes = r.wait()
    assert all(c == 0 for c in codes.values()), (codes, r.stderr())
    results = {(v, i): json.loads(store.get(f"result/{v}/{i}")) for v in range(1, versions + 1) for i in range(inferences)}
    for (v, i), res in results.items():
        assert res["bit_exact"], f"version {v} on inference rank {i} differs from the trainers' cast bytes"
        assert res["digest"] == res["trainers_digest"]
    sent = {(v, t): json.loads(store.get(f"sent/{v}/{t}")) for v in range(1, versions + 1) for t in range(trainers)}
    return results, sent


def wire(sent, v):
    return sum(s["wire_bytes"] for (u, _), s in sent.items() if u == v)


@pytest.mark.parametrize("trainers,inferences", first_in_unit([(2, 3), (1, 1)]))
def test_delta_versions_arrive_bit_for_bit(ranks, store, trainers, inferences):  # noqa: F811
    everyone = dict.fromkeys(range(inferences))
    bases = [everyone, {i: 1 for i in everyone}, {i: 2 for i in everyone}]
    results, sent = run_versions(ranks, store, trainers, inferences, "bfloat16", bases)
    plan = make_plan(layout_of(SHAPES, "bfloat16"), trainers, inferences, BUCKET)
    whole = plan.version_bytes * inferences
    assert wire(sent, 1) == whole and all(res["patched"] == 0 for (v, _), res in results.items() if v == 1)
    for v in (2, 3):
        assert wire(sent, v) < whole / 10, f"version {v}: {wire(sent, v)} bytes on the wire for 2% changed"
        assert all(results[(v, i)]["patched"] == len(plan.buckets) and not results[(v, i)]["refused"]
                   for i in range(inferences))
        changed = sum(s["changed"] for (u, _), s in sent.items() if u == v)
        compared = sum(s["compared"] for (u, _), s in sent.items() if u == v)
        assert 0.01 < changed / compared < 0.03


def test_delta_versions_of_fsdp_shards_patch_buckets_that_bundle_runs(ranks, store):  # noqa: F811
    """Trainer ranks hold FSDP2 shards; a bucket bundles a rank's runs of several tensors and its
    patch spans them: the receiver reads its base from, and writes the new bytes to, every run."""
    bases = [{0: None, 1: None}, {0: 1, 1: 1}]
    results, sent = run_versions(ranks, store, 3, 2, "bfloat16", bases, "--fsdp")
    plan = plan_of(layout_of(SHAPES, "bfloat16"), 3, 2, BUCKET, fsdp=True)
    assert any(b.parts for b in plan.buckets)
    assert all(results[(2, i)]["patched"] == len(plan.buckets) and not results[(2, i)]["refused"] for i in range(2))
    assert wire(sent, 2) < plan.version_bytes * 2 / 10


def test_a_rank_whose_base_differs_or_that_holds_nothing_gets_the_buckets_whole(ranks, store):  # noqa: F811
    """Version 2 to three inference ranks: rank 0 holds version 1 and is patched as usual; rank 1's
    copy of version 1 differs from the trainers': it refuses every patch of version 2, and the same
    version arrives whole and verified; rank 2 is new at version 2 (the controller names no base
    for it): its buckets go whole, none refused."""
    bases = [{0: None, 1: None, 2: None}, {0: 1, 1: 1, 2: None}]
    results, sent = run_versions(ranks, store, 2, 3, "bfloat16", bases, spoil=(1,))
    plan = make_plan(layout_of(SHAPES, "bfloat16"), 2, 3, BUCKET)
    assert results[(2, 0)]["patched"] == len(plan.buckets) and not results[(2, 0)]["refused"]
    assert results[(2, 1)]["patched"] == 0 and len(results[(2, 1)]["refused"]) == len(plan.buckets)
    assert all("differs from the sender's" in reason for reason in results[(2, 1)]["refused"])
    assert results[(2, 2)]["patched"] == 0 and not results[(2, 2)]["refused"]
    # rank 1's buckets re-sent whole and rank 2's sent whole, beside the patches (2% changed) of
    # ranks 0 and 1: rank 2 was sent no patch first
    assert 2 * plan.version_bytes < wire(sent, 2) < 2.2 * plan.version_bytes


def test_a_version_where_everything_changed_costs_the_whole_bytes(ranks, store):  # noqa: F811
    # bfloat16; a float32 bucket where everything changed: test_a_bucket_where_everything_changed_goes_whole
    bases = [{0: None, 1: None}, {0: 1, 1: 1}]
    results, sent = run_versions(ranks, store, 2, 2, "bfloat16", bases, change=1.0)
    plan = make_plan(layout_of(SHAPES, "bfloat16"), 2, 2, BUCKET)
    assert wire(sent, 2) == plan.version_bytes * 2
    assert all(results[(2, i)]["patched"] == 0 and not results[(2, i)]["refused"] for i in range(2))
