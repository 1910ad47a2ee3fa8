"""kopf handlers: settings at start-up, the job's own lifecycle, and the children it watches."""

from weightsync_operator.handlers import children, jobs, startup  # noqa: F401
