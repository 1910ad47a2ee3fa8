"""Who sends which bytes to whom: the plan of a version, made once per round from what every
trainer holds and what every inference rank needs (whole replicas, FSDP2 shards, tensor-parallel
slices), balanced by bytes, and its simulation at scale. Torch-free: the controller plans without
it, and `weightsync plan --simulate` plans a trillion parameters on a laptop."""
