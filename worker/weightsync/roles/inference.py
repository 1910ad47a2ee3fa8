"""An inference rank: generates with the latest verified weights, switching versions atomically.

The model's parameters (or, where versions are a LoRA adapter, its adapter's: model/lora.py) are
views into one of two flat buffers. A background thread receives
each new version into the other one (staging) and verifies it; the generation loop switches the
parameters to it between two generations. A model never runs on half-updated weights, and a
version that fails verification is never switched to: the old one stays and the rank fails. A
switch that fails part-way puts the parameters back on the buffer of the version the model ran,
which the receiving thread never writes: the model runs on that version whole again.

Receiving and verifying each round, and rejoining after a restart, are inbound.py's, shared with
vLLM's workers.
"""

from __future__ import annotations

import torch

from weightsync.job import INFERENCE, WorkerContext
from weightsync.model.build import greedy, logits, parameters, point_at, prompt
from weightsync.model.flat import views
from weightsync.rendezvous.protocol import who
from weightsync.roles.builtin import GENERATE_EVERY, NEW_TOKENS, device_for, serving_model
from weightsync.roles.sharded import ShardedInference
from weightsync.runtime import health
from weightsync.runtime.faults import (
    FAIL_LOAD_ENV,
    LoadFault,
    dump,
    dumping,
    generating,
    half_of,
    load_fails,
)
from weightsync.runtime.inbound import GenerationHandover
from weightsync.runtime.life import RankLife
from weightsync.runtime.rank import log
from weightsync.transfer.receive import VersionReceiver


def run(ctx: WorkerContext, rank: int, local_rank: int) -> int:
    """An inference rank of the built-in engine, to the job's end: a rank of a tensor-parallel
    replica holds a shard of it (sharded.py), any other the whole model."""
    body = ShardedInference if len(ctx.job.layout.tp_group(rank)) > 1 else Inference
    life = RankLife(ctx, INFERENCE, rank)
    return life.run(body(ctx, life, local_rank).run)


class Generations(GenerationHandover):
    """The double buffer. The receiving thread offers a verified version in the staging buffer;
    the generation loop switches to it between generations, and only then does the staging
    buffer become the other one."""

    def __init__(self, params: list, buffers: list, layout, quantization: str | None = None, rank: int = 0):
        super().__init__()
        self.params, self.buffers, self.layout, self.quantization = params, buffers, layout, quantization
        self.rank = rank
        self.rolled_back: int | None = None  # a version whose switch failed, until the loop said so
        self.views = [views(b, layout) for b in buffers]
        self.active = 0
        self._point()

    def _point(self, version: int | None = None) -> None:
        """The parameters onto the active buffer (a quantized version's weights dequantized from it),
        `version`'s where it is a new one (faults.FAIL_LOAD_ENV may fail that half-way)."""
        if version is not None and load_fails(self.rank, version):
            half = half_of(self.layout.names) if self.quantization is None else 0
            point_at(self.params[:half], self.views[self.active][:half])
            raise LoadFault(f"the switch to version {version} failed after {half} of its {len(self.params)} "
                            f"parameters (half of its layers; {FAIL_LOAD_ENV})")
        point_at(self.params, self.views[self.active], self.layout, self.quantization)

    def staging(self):
        return self.buffers[1 - self.active]

    def base(self, version: int | None):
        """(version, its buffer) when the model runs on `version`: what a delta of the next
        version is applied to (only read, while the model runs on it); else None."""
        with self.cond:
            return (version, self.buffers[self.active]) if version is not None and version == self.version else None

    # the generation loop
    def switch(self) -> int | None:
        """Point the model at the staged version, if one is waiting; returns its number. A switch
        that fails part-way puts every parameter back on the version the model ran (its buffer is
        untouched: versions are received into the other one), and the receiving thread hears why."""
        with self.cond:
            if self.staged is None:
                return None
            self.active = 1 - self.active
            try:
                self._point(self.staged)
            except Exception as e:  # noqa: BLE001 - handed to the receiving thread (inbound.LoadFailed)
                self.active = 1 - self.active
                self._point()
                self.load_error, self.rolled_back, self.staged = (self.staged, e), self.staged, None
                self.cond.notify_all()
                return None
            self.version, self.staged = self.staged, None
            self.cond.notify_all()
            return self.version


class Inference:
    def __init__(self, ctx: WorkerContext, life: RankLife, local_rank: int):
        self.ctx, self.life, self.rank, self.local_rank = ctx, life, life.rank, local_rank
        self.transfer = ctx.job.transfer
        self.me = who(INFERENCE, self.rank)

    def run(self) -> str:
        life = self.life
        device = device_for(self.ctx, INFERENCE, self.local_rank)
        life.heartbeat()
        model, layout, params = serving_model(self.ctx, device)
        buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        # the weights the model was built with are dropped here
        gens = Generations(params, buffers, layout, self.ctx.job.model.quantization, self.rank)
        started = life.start(device, layout.to_json(), port=self.ctx.data_port + self.local_rank)  # its model built
        joined, plan = started.joined, started.plan
        name, why, receiver, endpoint, attempt = joined.transport, joined.why, joined.end, joined.endpoint, joined.attempt
        again = f" (start {attempt}: rejoining the running job)" if attempt > 1 else ""
        log(self.me, f"on {device}, {name} transport ({why}); listening on {endpoint}; {plan.bytes_for(self.rank)} "
                     f"bytes per version from {len(plan.expected_for(self.rank))} trainer ranks{again}")

        life.settle()
        mover = gens.start_receiving(life.member, VersionReceiver(receiver, plan, self.rank), self.ctx.job)
        try:
            self._generate(model, gens, device)
        finally:
            mover.join(timeout=5.0)
            life.stop()
        return gens.end.state

    def _generate(self, model, gens: Generations, device) -> None:
        """Generate from the fixed prompt with whatever version is active; switch between generations."""
        ids = prompt(model, device)
        # one line per version: the switch, with what the version generates (not again at every
        # generation, GENERATE_EVERY)
        while True:
            gens.next_event(GENERATE_EVERY if gens.version is not None else None)
            if gens.error is not None:
                raise gens.error
            switched = gens.switch()
            if switched is not None:
                verified = " (digest verified)" if self.transfer.verify_digest else ""
                health.ready()  # serving a verified version: the pod is ready
            if switched is not None and dumping():
                tensors = {n: p.detach().cpu().clone() for n, p in parameters(model)}
                dump(INFERENCE, self.rank, switched, tensors, logits(model, ids).cpu())
            if switched is not None and (gens.end is not None or not generating()):
                log(self.me, f"switched to version {switched}{verified}")
            if gens.end is not None:
                return
            failed, gens.rolled_back = gens.rolled_back, None
            if gens.version is not None and generating():
                tokens = greedy(model, ids, NEW_TOKENS)
                if switched is not None:
                    log(self.me, f"switched to version {switched}{verified}; version {switched} generates {tokens} "
                                 f"from {ids[0].tolist()}")
                if failed is not None:
                    log(self.me, f"the switch to version {failed} failed part-way; back on version {gens.version}, "
                                 f"which generates {tokens} from {ids[0].tolist()}")
