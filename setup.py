"""The compiled pieces: the float32 -> bfloat16 cast a trainer runs on CPU
(worker/weightsync/model/_cast.c) and the inner loops of delta versions
(worker/weightsync/transfer/_delta.c); everything else is in pyproject.toml. Optional, so that the
operator, which neither casts nor sends deltas, installs without a C compiler; the worker image and
`make setup` check that they were built."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("weightsync.model._cast", ["worker/weightsync/model/_cast.c"], optional=True),
                   Extension("weightsync.transfer._delta", ["worker/weightsync/transfer/_delta.c"], optional=True)])
