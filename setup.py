"""The one compiled piece: the float32 -> bfloat16 cast a trainer runs on CPU
(worker/weightsync/model/_cast.c); everything else is in pyproject.toml. Optional, so that the
operator, which never casts, installs without a C compiler; the worker image and `make setup`
check that it was built."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("weightsync.model._cast", ["worker/weightsync/model/_cast.c"], optional=True)])
