"""The weightsync operator. `kopf run -m weightsync_operator` imports this package, which
registers the handlers; render, network, decisions, status, report, tokens and kube are plain
modules the handlers use."""

from weightsync_operator import handlers  # noqa: F401  (registers the kopf handlers)
