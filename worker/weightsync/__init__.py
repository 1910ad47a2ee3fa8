"""weightsync: fresh weights from training ranks to inference ranks, M to N.

The trainer-side API (weightsync.publisher.sync) is imported on first use, so that importing the
package (the operator does) loads no torch: attach, Sync, Published, Resumed, JobEnded, Resuming."""

__version__ = "0.1.0"

_API = {"attach": "publisher.sync", "Sync": "publisher.sync", "Published": "publisher.sync",
        "Resumed": "publisher.sync", "JobEnded": "rendezvous.protocol", "Resuming": "rendezvous.protocol"}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_API[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
