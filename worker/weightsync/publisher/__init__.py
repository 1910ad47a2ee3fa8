"""The trainer-side API behind `weightsync.attach(model)`: what a trainer rank holds (DDP
replicas or FSDP2 shards), the receivers it sends to, and `Sync.publish`, which sends one version
through the transfer layer. Used by the built-in trainer and by a user's own script alike."""
