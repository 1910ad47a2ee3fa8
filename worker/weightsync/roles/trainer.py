"""A trainer rank: trains the causal LM (DDP among the trainer ranks) and, before training and
every transfer.everySteps steps, sends its share of the new weights as the plan says."""

from __future__ import annotations

import copy
import datetime

import torch

from ..contract import TRAINER, WorkerContext
from ..data import MarkovTokens, rank_generator
from ..flat import torch_dtype
from ..model import build, check_fits, layout_of, logits, parameters, prompt, vocab_size
from ..rendezvous import Member, versions, who
from ..transfer import VersionSender, settle_heap
from .common import JOIN_TIMEOUT, device_for, dump, dumping, info, log, run_rank, transport_for


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
        sender.connect(endpoints)
        mover = VersionSender(sender, plan, rank, transfer["bucketMB"] << 20)
        log(self.me, f"on {device}, {name} transport ({why}); sends {sum(b.length for b in plan.buckets_of(rank))} "
                     f"of {plan.version_bytes} bytes per version to {len(endpoints)} inference ranks")

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
                    loss = ddp(input_ids=tokens, labels=tokens).loss
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.detach())
                    step += 1
                mean_loss = self._mean_loss(losses, device)
                losses = []
                member.set(f"ready/{version}/{rank}", "1")
                member.wait_for(f"go/{version}", f"the controller's go for version {version}", poll_max=0.002)
                sent = mover.send(version, params)
                member.set(f"sent/{version}/{rank}", {"checksums": {str(o): c for o, c in sent.checksums.items()},
                                                      "bytes": sent.bytes, "seconds": sent.seconds, "step": step,
                                                      "loss": mean_loss})
                loss_text = f", loss {mean_loss:.4f}" if mean_loss is not None else ""
                log(self.me, f"version {version} at step {step}{loss_text}: sent {sent.bytes} bytes in {sent.seconds:.4f}s")
                if dumping():
                    self._dump(model, version, spec["model"]["dtype"], device)
            end = member.wait_for_end()
        finally:
            member.stop_heartbeat()
            sender.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        return end["state"]

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
