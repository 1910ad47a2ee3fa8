"""`weightsync bench`: the benchmarks, each printing its baseline from the same run (planned
M-to-N against a broadcast, vLLM updates against a checkpoint reload, GPU paths against plain
device copies, shaped links against the speed of light). Nothing in weightsync imports them."""
