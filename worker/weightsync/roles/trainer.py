"""A trainer rank: trains the causal LM (DDP among the trainer ranks) and, before training and
every transfer.everySteps steps, sends its share of the new weights as the plan says, to the
inference ranks the controller's go names; then, until the job ends, the final version again to
inference ranks that come back after it went out (the weights no longer change by then)."""

from __future__ import annotations

import copy
import datetime

import torch

from .. import health
from ..contract import INFERENCE, TRAINER, WorkerContext
from ..data import MarkovTokens, rank_generator
from ..deltaplan import delta_in_effect
from ..flat import torch_dtype
from ..model import build, check_fits, layout_of, logits, parameters, prompt, train_step, vocab_size
from ..rendezvous import JobEnded, Keys, Member, Peer, Round, versions, who
from ..transfer import SentVersion, VersionSender, settle_heap
from ..transport.base import TransferError
from .common import JOIN_TIMEOUT, device_for, dump, dumping, info, log, pause_point, run_rank, transport_for


def run(ctx: WorkerContext, rank: int, local_rank: int) -> int:
    return run_rank(ctx, TRAINER, rank, local_rank, Trainer)


class Trainer:
    def __init__(self, ctx: WorkerContext, member: Member, rank: int, local_rank: int):
        self.ctx, self.member, self.rank, self.local_rank = ctx, member, rank, local_rank
        self.spec = ctx.job.spec
        self.me = who(TRAINER, rank)

    def run(self) -> str:
        spec, member, rank = self.spec, self.member, self.rank
        training, transfer = spec["training"], spec["transfer"]
        timeout = float(transfer["timeoutSeconds"])
        device = device_for(self.ctx, TRAINER, self.local_rank)
        member.start_heartbeat()

        check_fits(spec)
        model = build(spec["model"], dtype="float32", device=device, seed=training["seed"])
        model.train()
        layout = layout_of(model, spec["model"]["dtype"])
        name, why, sender = transport_for(self.ctx, member, TRAINER, rank, device)
        member.join(self.ctx.pod_ip, layout.to_json(), info(self.ctx, name, why, device), JOIN_TIMEOUT)
        plan, endpoints = member.plan(JOIN_TIMEOUT)
        health.ready()
        links = Links(sender, member, endpoints, timeout)
        links.follow(Round(0, receivers=tuple(endpoints)))
        mover = VersionSender(sender, plan, rank, transfer["bucketMB"] << 20, delta=delta_in_effect(self.ctx.job.delta, name)[0])
        kept = f"; keeps the last {mover.kept_bytes} sent for delta versions" if mover.kept_bytes else ""
        log(self.me, f"on {device}, {name} transport ({why}); sends {sum(b.length for b in plan.buckets_of(rank))} "
                     f"of {plan.version_bytes} bytes per version to {len(endpoints)} inference ranks{kept}")

        ddp = self._ddp(model, device, timeout)
        optimizer = torch.optim.AdamW(model.parameters(), lr=training["learningRate"])
        data = MarkovTokens(vocab_size(model), training["seed"])
        generator = rank_generator(training["seed"], rank)
        params = [p for _, p in parameters(model)]
        step, losses = 0, []
        settle_heap()
        try:
            for version, at_step in versions(spec):
                while step < at_step:
                    tokens = data.batch(training["batchSize"], training["seqLen"], generator).to(device)
                    losses.append(train_step(ddp, optimizer, tokens))
                    step += 1
                mean_loss = self._mean_loss(losses, device)
                losses = []
                member.set(Keys.ready(version, rank), "1")
                pause_point(TRAINER, rank, "before-go", version)
                sent = self._send(links, mover, member.round(version, poll_max=0.002), params, step, mean_loss)
                loss_text = f", loss {mean_loss:.4f}" if mean_loss is not None else ""
                log(self.me, f"version {version} at step {step}{loss_text}: sent {sent.bytes} bytes in {sent.seconds:.4f}s "
                             f"({sent.wire_bytes} bytes on the wire)")
                if dumping():
                    self._dump(model, version, spec["model"]["dtype"], device)
            state = self._send_final_again(links, mover, version, params, step)
        finally:
            member.stop_heartbeat()
            sender.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        return state

    def _send(self, links: "Links", mover: VersionSender, rnd: Round, params, step: int, loss: float | None) -> SentVersion:
        """Send a round to its receivers; the ones lost on the way are reported, not fatal: the
        controller counts them away until they rejoin."""
        lost = links.follow(rnd)
        with self.member.cuts(rnd, links.sender.cut):
            sent = mover.send(rnd.version, params, [r for r in rnd.receivers if r not in lost], lose_peers=True,
                              after_bucket=lambda k: k == 0 and pause_point(TRAINER, self.rank, "mid-send", rnd.version),
                              bases=rnd.bases)
        lost.update(sent.lost)
        for r, why in lost.items():
            links.sender.drop(r)
            log(self.me, f"lost inference rank {r} while sending {rnd.name}: {why}")
        self.member.set(Keys.sent(rnd.version, rnd.again, self.rank),
                        {"checksums": {str(o): c for o, c in sent.checksums.items()}, "bytes": sent.bytes,
                         "seconds": sent.seconds, "step": step, "loss": loss, "lost": {str(r): w for r, w in lost.items()},
                         "wire_bytes": sent.wire_bytes, "changed": sent.changed, "compared": sent.compared})
        return sent

    def _send_final_again(self, links: "Links", mover: VersionSender, final: int, params, step: int) -> str:
        """After the final version: send it again whenever the controller says so, until the end."""
        again = 1
        while True:
            try:
                rnd = self.member.round(final, again)
            except JobEnded as e:
                return e.state
            sent = self._send(links, mover, rnd, params, step, None)
            log(self.me, f"{rnd.name} to inference ranks {list(rnd.receivers)}: sent {sent.bytes} bytes in {sent.seconds:.4f}s")
            again += 1

    def _ddp(self, model, device, timeout: float):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        world = self.ctx.job.layout.world_size(TRAINER)
        store = dist.PrefixStore("ddp/", self.member.client().store)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    @staticmethod
    def _mean_loss(losses: list, device) -> float | None:
        """The mean training loss since the last version, over all trainer ranks."""
        if not losses:
            return None
        total = torch.stack(losses).mean().reshape(1).to(device)
        torch.distributed.all_reduce(total)
        return total.item() / torch.distributed.get_world_size()

    def _dump(self, model, version: int, dtype: str, device) -> None:
        cast = copy.deepcopy(model).to(torch_dtype(dtype))
        tensors = {n: p.detach().cpu() for n, p in parameters(cast)}
        dump(TRAINER, self.rank, version, tensors, logits(cast, prompt(cast, device)).cpu())


class Links:
    """This trainer's connections to the inference ranks, kept in step with the rounds: a rank
    that went away is dropped, and one that came back (a new attempt, at its new endpoint or at
    the same one) is dialled again."""

    def __init__(self, sender, member: Member, endpoints: dict[int, str], timeout: float):
        self.sender, self.member, self.timeout = sender, member, timeout
        self.peers, self.epoch = {r: Peer(e, 1) for r, e in endpoints.items()}, 0

    def follow(self, rnd: Round) -> dict[int, str]:
        """Connect to every receiver of the round; returns {rank: why} for those it cannot reach."""
        if rnd.epoch != self.epoch:
            peers = self.member.peers(rnd.epoch, self.timeout)
            for r, peer in peers.items():
                if self.peers.get(r) != peer:
                    self.sender.drop(r)
            self.peers, self.epoch = peers, rnd.epoch
        for r in self.peers:
            if r not in rnd.receivers and self.sender.connected(r):
                self.sender.drop(r)  # away: it gets nothing until it is back
        missing = {r: self.peers[r].endpoint for r in rnd.receivers if not self.sender.connected(r)}
        try:
            self.sender.connect(missing)  # all at once; the ones that answer are connected
        except TransferError as e:
            return {r: str(e) if e.peer == who(INFERENCE, r) else f"could not connect to {endpoint}"
                    for r, endpoint in missing.items() if not self.sender.connected(r)}
        return {}
