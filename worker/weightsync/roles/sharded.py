"""An inference rank of a tensor-parallel model replica (spec.inference.tensorParallel or
tensorParallelSizes above 1).

It holds one shard of its replica's model (tp_engine.py: transformers' own TP plan over the
replica's processes) and declares, when it joins, the slices of the version it needs; the
controller plans over slices and it receives only those, into a staging buffer of its local
layout, verified against its own digest (inbound.py). The generation loop copies a verified
version into the local shards between two generations, once every rank of the replica has it:
the replica's forward passes are collectives, so its ranks run the loop in lockstep, agreeing
each generation on whether to switch and whether the job ended.

The replica goes away and comes back as a whole (the roster's policy.tp_replicas): a rank whose
process ends breaks the group, so its peers, counted away with it, end too (a collective that
failed waits for the controller to say so), and every rank starts again, joins with its new start
and only then forms the replica's group anew, under the count of its departures (Keys.replica).
"""

from __future__ import annotations

import time

import torch

from weightsync.job import INFERENCE, WorkerContext
from weightsync.model.build import greedy, logits, prompt
from weightsync.plan.sliced_plan import needs_to_json
from weightsync.rendezvous.protocol import who
from weightsync.roles.builtin import GENERATE_EVERY, NEW_TOKENS, device_for, serving_model
from weightsync.roles.tp_engine import TensorParallel, load, local_shards, needs_of
from weightsync.runtime import health
from weightsync.runtime.faults import dump, dumping, generating
from weightsync.runtime.inbound import VERDICT_WAIT, GenerationHandover, StartAgain
from weightsync.runtime.life import RankLife
from weightsync.runtime.rank import Expected, log
from weightsync.transfer.receive import VersionReceiver


class ShardedGenerations(GenerationHandover):
    """inbound.GenerationHandover of a TP rank: one staging buffer; the receiving thread offers a verified
    version there and waits until the generation loop has copied it into the shards."""

    def __init__(self, nbytes: int, device):
        super().__init__()
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def staging(self):
        return self.buffer

    def base(self, version: int | None):
        return None  # no delta versions over slices

    def switched(self, version: int) -> None:
        with self.cond:
            self.version, self.staged = version, None
            self.cond.notify_all()


class ShardedInference:
    def __init__(self, ctx: WorkerContext, life: RankLife, local_rank: int):
        self.ctx, self.life, self.rank, self.local_rank = ctx, life, life.rank, local_rank
        self.member = life.member
        self.transfer = ctx.job.transfer
        self.me = who(INFERENCE, self.rank)
        self.group = ctx.job.layout.tp_group(self.rank)

    def run(self) -> str:
        life, member = self.life, self.member
        device = device_for(self.ctx, INFERENCE, self.local_rank)
        life.heartbeat()
        model, layout, _ = serving_model(self.ctx, device)  # no LoRA here: the CRD refuses it with TP
        try:
            needs = needs_of(model, layout, self.group, self.rank)
        except ValueError as e:
            raise Expected(f"tensor-parallel degree {len(self.group)} (spec.inference): {e}") from None
        joined = life.join(device, layout.to_json(), port=self.ctx.data_port + self.local_rank,
                           needs=needs_to_json(needs))
        name, why, receiver, endpoint = joined.transport, joined.why, joined.end, joined.endpoint
        try:
            # after the join: a start that rejoins forms the replica's group anew with its peers, which
            # were counted away with it and start again too (the controller takes the replica back whole)
            tp = TensorParallel(member.c10d_store(), self.group, self.rank, device, self.transfer.timeout,
                                member.replica_epoch(self.group.start))
            try:
                tp.shard(model)
                plan, _ = life.plan()
                if not getattr(plan, "sliced", False):
                    raise Expected("the controller planned whole versions for a tensor-parallel replica")
                local = plan.local_of(self.rank)
                gens = ShardedGenerations(local.total_bytes, device)
                log(self.me, f"on {device}, {name} transport ({why}); listening on {endpoint}; TP rank "
                             f"{self.rank - self.group.start} of {len(self.group)} (inference ranks {self.group.start}.."
                             f"{self.group.stop - 1}); {local.total_bytes} of {plan.version_bytes} bytes per version "
                             f"from {len(plan.expected_for(self.rank))} trainer ranks")
                life.settle()
                mover = gens.start_receiving(member, VersionReceiver(receiver, plan, self.rank), self.ctx.job)
                try:
                    self._generate(model, tp, layout, local, gens, device)
                finally:
                    mover.join(timeout=5.0)
                    life.stop()
            finally:
                tp.close()
        finally:
            life.close()
        return gens.end.state

    def _generate(self, model, tp: TensorParallel, layout, local, gens: ShardedGenerations, device) -> None:
        """Generate with whatever version the replica runs, in lockstep with the replica's other ranks."""
        ids = prompt(model, device)
        try:
            while True:
                gens.next_event(GENERATE_EVERY if gens.version is not None else 0.05)
                if gens.error is not None:
                    raise gens.error
                version, ended = tp.agree(gens.staged, gens.end is not None)
                if version is not None:
                    load(model, layout, local, gens.buffer)
                    gens.switched(version)
                    verified = " (digest verified)" if self.transfer.verify_digest else ""
                    log(self.me, f"switched to version {version}{verified}")
                    health.ready()
                    if dumping():
                        tensors = {n: t.detach().cpu().clone() for n, t in local_shards(model).items()}
                        dump(INFERENCE, self.rank, version, tensors, logits(model, ids).cpu())
                if ended:
                    return
                if gens.version is not None and version is not None and generating():
                    log(self.me, f"version {gens.version} generates {greedy(model, ids, NEW_TOKENS)} from {ids[0].tolist()}")
        except RuntimeError as e:  # a collective of the replica failed: its group broke
            if e is gens.error:
                raise
            raise self._peer_gone(e, gens) from None

    def _peer_gone(self, error: RuntimeError, gens: ShardedGenerations) -> BaseException:
        """What a collective of the replica that failed means: a peer's process ended (it died, or
        was counted away and ends to start again). The controller counts this rank away with it
        within its silence limit, and this start then ends to start again with the replica (or its
        own receiving thread found so first); past that wait, the error stands."""
        deadline = time.monotonic() + VERDICT_WAIT
        while time.monotonic() < deadline:
            if isinstance(gens.error, StartAgain):
                return gens.error
            if (why := self.member.away()) is not None:
                return StartAgain(f"the replica's process group broke ({error}): the controller counted this rank away "
                                  f"({why}); ending this process so that the replica starts again and rejoins")
            time.sleep(0.2)
        return error
