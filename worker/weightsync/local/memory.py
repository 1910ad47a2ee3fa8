"""Will a job's processes fit in this machine's memory? Estimated before `weightsync run` starts
any of them, because a process that does not fit is killed by the kernel's OOM killer (SIGKILL)
half-way through, with an empty log.

The estimate is a floor, from the model's parameter count (meta device, nothing allocated) and
what each role holds for the whole run; activations come on top. A process that computes on a GPU
keeps its model there, so on the host it counts only its runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from weightsync.job import INFERENCE, TRAINER, Job
from weightsync.model.flat import ITEMSIZE, FlatLayout
from weightsync.transfer.held import KEPT_SHARE

MiB, GiB = 1 << 20, 1 << 30
# Private memory (RssAnon) of a process beyond the weights and state counted below, as measured on
# CPU (torch 2.15, transformers 5): an inference rank, and the controller, which holds no weights.
RANK_RUNTIME = 400 * MiB
CONTROLLER_RUNTIME = 300 * MiB
SEND_DEPTH = 2  # transfer.VersionSender's default: cast buffers of one bucket each
# float32 weights, their gradients, AdamW's two moments; DDP among several trainer ranks keeps its
# own copy of the gradients in its communication buckets.
TRAINER_BYTES_PER_PARAM = 4 + 4 + 8
DDP_BYTES_PER_PARAM = 4
# An inference rank holds the version it runs and the one it receives into, and the weights it was
# built with until it first points the model at those buffers.
INFERENCE_VERSIONS = 3


@dataclass(frozen=True)
class Need:
    """What the processes of one role need, each."""

    role: str
    processes: int
    each: int  # bytes per process
    why: str

    @property
    def total(self) -> int:
        return self.processes * self.each


def parameters(layout: FlatLayout) -> int:
    return sum(slot.nbytes // ITEMSIZE[slot.dtype] for slot in layout.slots)


def needs(job: Job, layout: FlatLayout) -> list[Need]:
    """Per role, the host memory of each of its processes on one machine; `layout` is the job's
    version layout (spec.model.dtype)."""
    lay = job.layout
    params = parameters(layout)
    version = layout.total_bytes
    per_param = TRAINER_BYTES_PER_PARAM + (DDP_BYTES_PER_PARAM if lay.world_size(TRAINER) > 1 else 0)
    delta = job.transfer.delta.enabled  # the last version sent is kept (host memory, also beside a GPU), and sent through buffers
    cast = SEND_DEPTH * min(job.transfer.bucket_bytes, version) if layout.dtype != "float32" or delta else 0
    kept = -(-version // lay.world_size(TRAINER)) if delta else 0
    what = "weights, gradients, AdamW's two moments" + (" and DDP buckets" if per_param > TRAINER_BYTES_PER_PARAM else "")
    trainer_state = params * per_param + cast
    trainer_why = f"{_count(params)} parameters x {per_param} bytes for float32 {what}" + (", send buffers" if cast else "")
    trainer_why += f", its share of the last version sent ({_size(kept)})" if kept else ""
    entries = int(version * KEPT_SHARE) if delta else 0  # at most, the last version's entries (transfer/held.py)
    inference_state = INFERENCE_VERSIONS * version + entries
    inference_why = f"{INFERENCE_VERSIONS} versions of {_size(version)} in {layout.dtype}"
    inference_why += f", the last version's patch entries (up to {_size(entries)})" if entries else ""
    out = [Need("controller", 1, CONTROLLER_RUNTIME, "runtime")]
    for role, state, why in ((TRAINER, trainer_state, trainer_why), (INFERENCE, inference_state, inference_why)):
        on_gpu = job.pods(role).gpus_per_proc > 0
        extra = kept if role == TRAINER else 0
        out.append(Need(role, lay.world_size(role), RANK_RUNTIME + (0 if on_gpu else state) + extra,
                        "runtime; its model state is on the GPU" if on_gpu else f"{why}, plus runtime"))
    return out


NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


def available(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """What this process can allocate, in bytes, and where that bound comes from: the machine's
    MemAvailable, or less where a memory cgroup around this process (a container's, a systemd
    slice's, one of its ancestors) allows less: its limit less what it already uses. None where
    neither says (no /proc/meminfo)."""
    bounds = []
    try:
        for line in Path(proc, "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                bounds.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    bounds += cgroup_room(proc, cgroups)
    return min(bounds) if bounds else None


def cgroup_room(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> list[tuple[int, str]]:
    """(limit less usage, which) of every memory cgroup from this process's own up to the root
    that has a limit: cgroup v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes,
    memory.usage_in_bytes). A cgroup namespace shows a container its own cgroup as the root."""
    try:
        lines = Path(proc, "self", "cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2: one unified hierarchy
            base, files = Path(cgroups), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = Path(cgroups, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        folder = base / path.lstrip("/")
        if not folder.is_dir():  # the process's path as the host names it, outside a cgroup namespace
            folder = base
        while True:
            try:
                limit_text = (folder / files[0]).read_text().strip()
                used = int((folder / files[1]).read_text())
                limit = NO_LIMIT if limit_text == "max" else int(limit_text)
            except (OSError, ValueError):
                limit = NO_LIMIT
            if limit < NO_LIMIT:
                out.append((max(limit - used, 0), f"the memory cgroup {folder}: {files[0]} {_size(limit)}, "
                                                  f"{_size(used)} of it in use"))
            if folder == base:
                break
            folder = folder.parent
    return out


def shortfall(job: Job, layout: FlatLayout, have: tuple[int, str] | None = None) -> str | None:
    """Why the job cannot fit in memory here, with the numbers; None when it fits (or when the
    machine does not say what it has)."""
    have = available() if have is None else have
    parts = needs(job, layout)
    total = sum(n.total for n in parts)
    if have is None or total <= have[0]:
        return None
    detail = "; ".join(f"{n.processes} {n.role} process{'es' if n.processes > 1 else ''} x {_size(n.each)} ({n.why})"
                       for n in parts if n.role != "controller")
    return (f"the job needs at least {_size(total)} of memory and this machine has {_size(have[0])} available "
            f"({have[1]}): {detail}; make spec.model smaller or run fewer processes")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"
