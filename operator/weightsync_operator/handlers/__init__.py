"""kopf handlers: settings at start-up, the job's own lifecycle, the children it watches, and the
Kueue Workloads of queued jobs."""

from weightsync_operator.handlers import children, jobs, queued, startup  # noqa: F401
