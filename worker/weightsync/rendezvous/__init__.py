"""The job's control plane: the controller's authenticated store, the protocol every rank speaks
over it (keys, rounds, typed messages), and the roster that admits ranks, watches their heartbeats
and lets restarted pods rejoin. No torch; nothing here moves weights."""
