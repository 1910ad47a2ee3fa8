"""Adapters that put weightsync inside other RL stacks' plug points: where another project defines
how weights go from its trainers to its rollout workers (verl's checkpoint-engine registry:
verl.py; vLLM's trainer-side weight-transfer engine factory: vllm.py, and vllm_job.py, the job such
a trainer runs itself where it has no job file), weightsync implements that interface exactly, as
a thin layer over the same controller, protocol, plan and verification that weightsync's own jobs
run (ranks.py). None of them is a second implementation of a transfer, and none holds another
project's internals outside its own module: ranks.py imports no other RL stack, and each stack is
reached from one module named for it.

This is the top layer of the worker but for the command: it may use every package below it (the
controller's role, the trainer API, the inference side of a round), and nothing below imports it.
"""
