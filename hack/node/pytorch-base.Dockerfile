# Stands in for the CUDA PyTorch image that Dockerfile.worker builds on (BASE_IMAGE), where no
# registry can provide one: the tests' Debian Python base, a compiler for the worker's native cast,
# and PyPI's torch (the CUDA build, which runs on CPUs too), as requirements/dev.lock pins it.
FROM python:3.12-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.15.0
# Debian's python3-packaging has no RECORD file, so pip cannot replace it with the lock's version
# when the worker image installs the lock: the lock's goes beside it, first on the path.
RUN pip install --no-cache-dir --ignore-installed packaging==26.4
