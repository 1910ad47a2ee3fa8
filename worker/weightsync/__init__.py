"""weightsync: move freshly trained weights from training ranks to inference ranks."""

__version__ = "0.1.0"
