"""What the transfer layer asks of a plan: the one vocabulary every planner speaks.

Three planners make a version's plan: segments.make_plan (every trainer rank holds every tensor
whole, every inference rank needs the whole version), holders.plan_by_holder (trainer ranks hold
FSDP2 shards; both of these make a segments.Plan) and sliced_plan.SlicedPlan (inference ranks hold
tensor-parallel slices). The send pipeline, the verifying receiver, the controller and the trainer
API read any of them through the two Protocols here and nothing else, as torch's distributed
checkpoint declares its planning vocabulary (SavePlan, LoadPlan, WriteItem) in one module. What a
bucket's bytes are made of (runs of the flat layout, or boxes of the global tensors) stays with
its planner: only the code that packs them reads it. No torch here.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

from weightsync.model.flat import FlatLayout


@runtime_checkable
class TransferBucket(Protocol):
    """One frame of a version: bytes one trainer rank sends in one go, with their checksum."""

    @property
    def trainer(self) -> int:
        """The trainer rank that sends it."""

    @property
    def receiver(self) -> int | None:
        """The one inference rank it goes to, or None: every inference rank gets it."""

    @property
    def offset(self) -> int:
        """Where its bytes land in its receiver's staging buffer: the frame's key, under which
        the receiver reports its checksum."""

    @property
    def length(self) -> int:
        """Its bytes."""


@runtime_checkable
class TransferPlan(Protocol):
    """Which trainer rank sends which bytes of a version to which inference rank."""

    @property
    def layout(self) -> FlatLayout:
        """The version's tensors in the transfer dtype, as the trainers declared them."""

    @property
    def trainers(self) -> int:
        """Trainer ranks in the plan (ranks 0 .. trainers - 1)."""

    @property
    def inferences(self) -> int:
        """Inference ranks in the plan (ranks 0 .. inferences - 1)."""

    @property
    def bucket_bytes(self) -> int:
        """The largest bucket: what one send buffer must hold."""

    @property
    def sliced(self) -> bool:
        """Whether inference ranks receive slices (each bucket goes to one of them, and each has a
        digest of its own) rather than the whole version (each bucket goes to all of them)."""

    @property
    def version_bytes(self) -> int:
        """The whole version in the transfer dtype."""

    def buckets_of(self, trainer: int) -> Sequence[TransferBucket]:
        """What trainer rank `trainer` sends, in sending order."""

    def expected_for(self, inference: int) -> dict[int, list[tuple[int, int]]]:
        """What inference rank `inference` receives: {trainer rank: [(offset, length) of each of
        its buckets]}, trainers that send it nothing left out."""

    def scatter_for(self, inference: int) -> Mapping[int, Sequence[tuple[int, int]]]:
        """{offset: runs (offset, length)} of the buckets inference rank `inference` receives that
        land in several runs of its staging buffer instead of one."""

    def bytes_for(self, inference: int) -> int:
        """The size of inference rank `inference`'s staging buffer."""

    def to_json(self) -> str:
        """The plan as the controller publishes it (sliced_plan.plan_from_json reads it back)."""

    def table(self) -> str:
        """The plan as text, for `weightsync plan`."""
