#!/usr/bin/env bash
# Fetch, where pip reaches PyPI, the wheels the GPU tier needs beyond what a GPU machine without
# a network has (Python 3.12, torch + CUDA, numpy, xxhash, pytest, safetensors, tqdm): blake3 and
# cryptography (with cffi, pycparser) for CPython 3.12 on x86-64 Linux, into .whl/ (ignored by
# git; carry it to the machine). scripts/gpu_check.sh installs them there, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl 'blake3>=1.0' 'cryptography>=42' 'cffi>=2.0' pycparser
ls -l .whl
