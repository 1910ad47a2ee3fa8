# Stands in for the CUDA PyTorch image that Dockerfile.worker builds on (BASE_IMAGE), where no
# registry can provide one: the tests' Debian Python base, a compiler for the worker's native cast,
# and PyPI's torch (the CUDA build, which runs on CPUs too).
FROM python:3.12-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.15.0
