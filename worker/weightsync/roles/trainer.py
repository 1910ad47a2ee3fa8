"""The built-in trainer rank: trains the causal LM of spec.model (DDP among the trainer ranks) and
publishes a version before training and every transfer.everySteps steps, through the public
trainer API (weightsync.publisher.sync) exactly as a user's own training script does."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from weightsync.job import TRAINER, WorkerContext, states
from weightsync.model.build import as_served, build, check_fits, logits, parameters, prompt, train_step, vocab_size
from weightsync.model.lora import add_adapters
from weightsync.model.markov import MarkovTokens, rank_generator
from weightsync.publisher.sources import local_tensors
from weightsync.publisher.sync import Sync
from weightsync.rendezvous.protocol import versions, who
from weightsync.roles.builtin import device_for
from weightsync.runtime.faults import dump, dumping
from weightsync.runtime.life import RankLife
from weightsync.runtime.rank import log


def run(ctx: WorkerContext, rank: int, local_rank: int) -> int:
    """Run the built-in trainer rank to the job's end: its life is every rank's (runtime/life.py),
    and the trainer API lives it once the model is attached."""
    life = RankLife(ctx, TRAINER, rank)
    return life.run(BuiltIn(ctx, life, local_rank).run)


class BuiltIn:
    def __init__(self, ctx: WorkerContext, life: RankLife, local_rank: int):
        self.ctx, self.life, self.rank, self.local_rank = ctx, life, life.rank, local_rank
        self.job = ctx.job
        self.me = who(TRAINER, self.rank)

    def run(self) -> str:
        job, training = self.job, self.job.training
        device = device_for(self.ctx, TRAINER, self.local_rank)
        check_fits(job.model, training.seq_len)
        model = build(job.model, dtype="float32", device=device, seed=training.seed)
        if job.model.lora is not None:  # train the adapter alone, as PEFT does: the base is frozen
            add_adapters(model, job.model.lora)
        model.train()
        with Sync(model, self.ctx, self.rank, self.life) as sync:
            ddp = self._ddp(sync, model, device)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=training.learning_rate)
            data = MarkovTokens(vocab_size(model), training.seed)
            generator = rank_generator(training.seed, self.rank)
            step, losses = 0, []
            self.life.settle()
            for version, at_step in versions(job):
                while step < at_step:
                    tokens = data.batch(training.batch_size, training.seq_len, generator).to(device)
                    losses.append(train_step(ddp, optimizer, tokens))
                    step += 1
                mean_loss = self._mean_loss(losses, device)
                losses = []
                sent = sync.publish(step=step, loss=mean_loss)
                loss_text = f", loss {mean_loss:.4f}" if mean_loss is not None else ""
                log(self.me, f"version {version} at step {step}{loss_text}: sent {sent.bytes} bytes in {sent.seconds:.4f}s "
                             f"({sent.wire_bytes} bytes on the wire)")
                if dumping():
                    self._dump(model, version, job.model.dtype, device, sync)
            if dist.is_initialized():
                dist.destroy_process_group()
        return states.SUCCEEDED  # close() raised JobEnded otherwise

    def _ddp(self, sync: Sync, model, device):
        """DDP among the trainer ranks, its process group met through the job's own rendezvous
        (authenticated with the job's token) rather than torchrun's."""
        world = self.ctx.job.layout.world_size(TRAINER)
        store = sync.store("ddp/")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=world,
                                timeout=datetime.timedelta(seconds=sync.timeout))
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    @staticmethod
    def _mean_loss(losses: list, device) -> float | None:
        """The mean training loss since the last version, over all trainer ranks."""
        if not losses:
            return None
        total = torch.stack(losses).mean().reshape(1).to(device)
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()

    def _dump(self, model, version: int, dtype: str, device, sync: Sync) -> None:
        # the version's tensors quantized, unless they are an adapter (over quantized base weights)
        quantization = self.ctx.job.model.quantization if self.ctx.job.model.lora is None else None
        cast = as_served(model, dtype, quantization)
        tensors = {n: p.detach().cpu() for n, p in parameters(cast)}
        sent = None
        if quantization is not None:  # the quantized tensors, as sent
            sent = {n: t.cpu() for n, t in zip(sync.sources.layout.names, local_tensors(model, sync.sources))}
        dump(TRAINER, self.rank, version, tensors, logits(cast, prompt(cast, device)).cpu(), sent)
