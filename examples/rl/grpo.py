"""A GRPO-style RL loop of your own through weightsync: the trainer learns a toy task from rewards
alone, sampling its rollouts from the job's vLLM servers, which serve every version it publishes.

Plain PyTorch, no RL framework. The task is verifiable and needs no tokenizer: a prompt is two
token ids [MARK, k] and the answer is one token; the reward is 1 when the answer is f(k) for a
fixed random mapping f, else 0. A randomly initialized model answers right about once in `vocab`
samples, so what it learns it learns from the rewards. Each step:

  1. asks the servers (Sync.servers(): their URLs, from the job) for --group samples of every
     prompt, at temperature 1, with the logprob vLLM sampled each with, over vLLM's generate route
     (/inference/v1/generate, served with --enable-scale-out, which weightsync's vLLM pods pass):
     unlike the OpenAI routes it names the weight version that produced every token;
  2. scores them, normalizes the rewards within each prompt's group (the advantages);
  3. takes one policy-gradient step on the clipped importance-weighted objective of PPO/GRPO: the
     ratio is between the trainer's own probability of each answer now and vLLM's when it sampled
     it, so rollouts from an older version (vLLM loads a version while the trainer goes on) are
     weighed for what they are;
  4. publishes the new weights (sync.publish): the servers load them as the next weight version.

Every rollout keeps the version vLLM says produced it; the staleness of a step is the trainer's
version (the last it published, the weights its step starts from) minus the rollouts' version.
Per step it prints the mean reward and staleness, appends a JSON line to OUT/metrics.jsonl (step,
mean reward, staleness, the rollouts' versions, the trainer's version) and redraws OUT/reward.png
(reward and staleness by step; needs matplotlib: pip install 'weightsync[examples]').

Run it as a job's spec.trainer.command (examples/rl/job.yaml) or by hand with the job's join
environment (examples/rl/external-job.yaml). The model is the job's spec.model.config, passed as
--config (examples/rl/model/config.json: the same config, as the servers started by hand load it).

With --lora RANK (examples/rl/lora-job.yaml, whose spec.model.lora says the same) the policy is a
frozen base checkpoint plus a PEFT LoRA adapter on every linear layer of the transformer, and only
the adapter trains: each version is the adapter alone, and the rollouts name the adapter
(--lora-name, spec.model.lora.name), so the servers run them on its newest version. The servers
and the trainer load the same base from --base, the job's spec.model.path, which --save-base DIR
writes first (a random Llama of --config, in bfloat16, the job's dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import weightsync

MARK = 1  # the prompts' first token: "name the token for"
FIRST_KEY = 2  # the keys k are the tokens FIRST_KEY .. FIRST_KEY + prompts - 1
# the LoRA variant's targets: every linear layer of a Llama's transformer layer (spec.model.lora.targetModules)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The adapter cannot touch the output head or the final norm, so how sure the policy can become of
# an answer is bounded by the frozen head's scale: at transformers' initializer_range of 0.02 an
# answer's probability stays below about 0.2. The LoRA variant's base is drawn at 0.05: its first
# samples still spread over the vocabulary, and the adapter can make an answer's probability
# approach 1.
LORA_BASE_INIT = 0.05
REQUEST_TIMEOUT = 120.0  # seconds for one generate request (the server may be loading a version)
SERVING_TIMEOUT = 300.0  # seconds for every server to serve the first version published


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="the job's spec.model.config: JSON, or a config.json file (a Llama, random "
                                         "init); with --lora the model is --base's")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts, all of them every step")
    parser.add_argument("--group", type=int, default=64, help="samples per prompt (GRPO's group)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.2, help="the importance ratio's clip range (PPO's epsilon)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="rl-out", help="folder for metrics.jsonl and reward.png")
    lora = parser.add_argument_group("LoRA", "train a PEFT LoRA adapter over a frozen base (examples/rl/lora-job.yaml)")
    lora.add_argument("--lora", type=int, metavar="RANK", help="the adapter's rank (spec.model.lora.rank)")
    lora.add_argument("--lora-alpha", type=int, help="spec.model.lora.alpha (default: twice the rank)")
    lora.add_argument("--lora-name", default="adapter", help="spec.model.lora.name: what the rollouts ask the servers for")
    lora.add_argument("--base", help="the base checkpoint, the job's spec.model.path")
    lora.add_argument("--save-base", metavar="DIR",
                      help="write the LoRA variant's base checkpoint (a random Llama of --config) to DIR and exit")
    args = parser.parse_args()
    if args.prompts < 1 or args.group < 2 or args.steps < 1:
        parser.error("--steps and --prompts must be at least 1, --group at least 2 (advantages compare a group)")
    if args.config is None and (args.lora is None or args.save_base):
        parser.error("--config is needed: the job's spec.model.config (or, with --lora, --base alone)")
    if args.lora is not None and (args.lora < 1 or args.base is None):
        parser.error("--lora RANK needs a rank of at least 1 and --base, the job's spec.model.path")
    if args.lora_alpha is None and args.lora is not None:
        args.lora_alpha = 2 * args.lora
    return args


@dataclass(frozen=True)
class Task:
    """Prompt [MARK, k] -> answer answers[k - FIRST_KEY]: a fixed random mapping onto the vocabulary."""

    answers: tuple[int, ...]

    @classmethod
    def make(cls, prompts: int, vocab: int, seed: int) -> Task:
        free = FIRST_KEY + prompts  # answers never collide with MARK or a key
        if vocab - free < prompts:
            raise SystemExit(f"the model's vocab_size {vocab} is too small for {prompts} prompts: "
                             f"it needs at least {free + prompts}")
        pick = torch.randperm(vocab - free, generator=torch.Generator().manual_seed(seed))[:prompts] + free
        return cls(tuple(int(a) for a in pick))

    def prompt(self, i: int) -> list[int]:
        return [MARK, FIRST_KEY + i]

    def reward(self, i: int, answer: int) -> float:
        return 1.0 if answer == self.answers[i] else 0.0


@dataclass(frozen=True)
class Rollout:
    prompt: int  # its index
    answer: int  # the token vLLM sampled
    logprob: float  # its log-probability under the weights that sampled it
    version: int  # those weights' version, as vLLM names it


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} answered {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def sample(server: str, task: Task, i: int, group: int, adapter: str | None = None) -> list[Rollout]:
    """`group` answers to prompt i from one server, each with its logprob and weight version; on
    the LoRA adapter served under the name `adapter` where one is given, else on the whole model."""
    got = post(server + "/inference/v1/generate", {
        **({"model": adapter} if adapter else {}), "token_ids": task.prompt(i),
        "sampling_params": {"n": group, "temperature": 1.0, "max_tokens": 1, "logprobs": 0, "ignore_eos": True}})
    rollouts = []
    for choice in got["choices"]:
        (answer,), (content,) = choice["token_ids"], choice["logprobs"]["content"]
        spans = choice.get("weight_versions") or []
        if len(spans) != 1 or not spans[0]["version"].isdigit():
            raise RuntimeError(f"{server} did not name one weightsync version for its answer: weight_versions={spans} "
                               "(is it a server of this job, loading weightsync's versions?)")
        rollouts.append(Rollout(i, answer, content["logprob"], int(spans[0]["version"])))
    return rollouts


def wait_until_serving(servers: tuple[str, ...], version: int) -> None:
    """Until every server serves `version` or a later one: vLLM starts on dummy weights, and a
    server started by hand joins the job while it loads the model, before its HTTP server is up."""
    deadline = time.monotonic() + SERVING_TIMEOUT
    for server in servers:
        while True:
            try:
                with urllib.request.urlopen(server + "/weight_info", timeout=REQUEST_TIMEOUT) as response:
                    served = json.loads(response.read())["weight_version"]
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"{server}/weight_info answered {e.code}: the server serves its weight version "
                                   "with VLLM_SERVER_DEV_MODE=1 in its environment") from None
            except urllib.error.URLError as e:  # not listening yet
                served = f"nothing yet: {e.reason}"
            if served is not None and str(served).isdigit() and int(served) >= version:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server} did not serve version {version} within {SERVING_TIMEOUT:.0f}s "
                                   f"(it serves {served!r})")
            time.sleep(0.2)


def read_config(config: str) -> dict:
    return json.loads(Path(config).read_text() if config.endswith(".json") else config)


def save_base(config: dict, seed: int, folder: Path) -> None:
    """The LoRA variant's base checkpoint: a random Llama of `config`, drawn at LORA_BASE_INIT, in
    bfloat16 (the job's spec.model.dtype), with config.json: what the servers and --base load."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**config, "initializer_range": LORA_BASE_INIT}))
    model.to(torch.bfloat16).save_pretrained(folder)


def policy(args: argparse.Namespace) -> torch.nn.Module:
    """The model to train: the whole random Llama of --config, or (--lora) the base checkpoint with
    a PEFT LoRA adapter whose parameters alone require gradients."""
    if args.lora is None:
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**read_config(args.config)))
    import peft  # pip install 'weightsync[examples]'

    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    return peft.get_peft_model(base, peft.LoraConfig(r=args.lora, lora_alpha=args.lora_alpha,
                                                     target_modules=list(LORA_TARGETS)))


def policy_loss(model, task: Task, rollouts: list[Rollout], advantages: torch.Tensor, clip: float):
    """PPO/GRPO's clipped surrogate: the ratio of the trainer's probability of each answer now to
    vLLM's when it sampled it, times the answer's advantage."""
    prompts = torch.tensor([task.prompt(r.prompt) for r in rollouts])
    logits = model(input_ids=prompts).logits[:, -1].float()
    answers = torch.tensor([r.answer for r in rollouts])
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, answers[:, None])[:, 0]
    ratio = torch.exp(logprobs - torch.tensor([r.logprob for r in rollouts]))
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    return loss, ratio.detach()


def advantages_of(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Each reward against its prompt's group: (r - mean) / (std + eps); a group that all agree gives 0."""
    grouped = rewards.view(-1, group)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + 1e-6)).view(-1)


def can_plot() -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # files only, no display
    return True


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    top.plot(steps, [r["mean_reward"] for r in rows], marker=".")
    top.set_ylabel("mean reward")
    top.set_ylim(-0.02, 1.02)
    top.set_title("GRPO through weightsync: reward and staleness by step")
    bottom.plot(steps, [r["staleness"] for r in rows], marker=".", label="mean")
    bottom.plot(steps, [r["max_staleness"] for r in rows], marker="x", linestyle=":", label="max")
    bottom.set_ylabel("staleness (versions)")
    bottom.set_xlabel("step")
    bottom.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    args = arguments()
    if args.save_base:
        save_base(read_config(args.config), args.seed, Path(args.save_base))
        print(f"the LoRA variant's base checkpoint is in {args.save_base}", flush=True)
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise SystemExit(f"this example trains on one trainer rank (spec.trainer: replicas 1, procsPerPod 1); "
                         f"WORLD_SIZE is {world}")
    torch.manual_seed(args.seed)
    model = policy(args).train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    task = Task.make(args.prompts, model.config.vocab_size, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.write_text("")
    rows: list[dict] = []
    plots = can_plot()
    if not plots:
        print(f"matplotlib is not installed (pip install 'weightsync[examples]'): no plot, only {metrics}",
              file=sys.stderr, flush=True)

    with weightsync.attach(model) as sync, ThreadPoolExecutor(max_workers=args.prompts) as pool:
        sync.publish(step=0)  # version 0: the initial weights
        servers = sync.servers()
        if not servers:
            raise SystemExit("the job's inference ranks serve no HTTP: set spec.inference.engine: vllm")
        adapter = args.lora_name if args.lora is not None else None
        print(f"vLLM servers: {', '.join(servers)}; {args.prompts} prompts x {args.group} samples a step"
              + (f" on the LoRA adapter {adapter!r}" if adapter else ""), flush=True)
        wait_until_serving(servers, 0)
        for step in range(args.steps):
            started = time.monotonic()
            batches = pool.map(lambda i: sample(servers[i % len(servers)], task, i, args.group, adapter),
                               range(args.prompts))
            rollouts = [r for batch in batches for r in batch]
            rewards = torch.tensor([task.reward(r.prompt, r.answer) for r in rollouts])
            loss, ratio = policy_loss(model, task, rollouts, advantages_of(rewards, args.group), args.clip)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            trainer_version = sync.version  # the weights this step started from
            versions = [r.version for r in rollouts]
            stale = [trainer_version - v for v in versions]
            published = sync.publish(step=step + 1, loss=loss.item())
            row = {"step": step, "mean_reward": round(rewards.mean().item(), 4),
                   "staleness": round(sum(stale) / len(stale), 4), "max_staleness": max(stale),
                   "prompt_rewards": [round(g.mean().item(), 3) for g in rewards.view(args.prompts, args.group)],
                   "rollout_versions": {str(v): versions.count(v) for v in sorted(set(versions))},
                   "trainer_version": trainer_version, "published_version": published.version,
                   "clipped": round(((ratio - 1).abs() > args.clip).float().mean().item(), 4),
                   "seconds": round(time.monotonic() - started, 3)}
            rows.append(row)
            with metrics.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"step {step}: mean reward {row['mean_reward']:.3f}, staleness {row['staleness']:.2f} "
                  f"(rollouts on versions {row['rollout_versions']}, trainer at {trainer_version}), "
                  f"{row['seconds']:.2f}s", flush=True)
            if plots and (step % 10 == 9 or step == args.steps - 1):
                plot(rows, out / "reward.png")
    print(f"metrics in {metrics}" + (f", plot in {out / 'reward.png'}" if plots else ""), flush=True)
    print(json.dumps({"task": asdict(task), "first_reward": rows[0]["mean_reward"], "last_reward": rows[-1]["mean_reward"]}),
          flush=True)


if __name__ == "__main__":
    main()
