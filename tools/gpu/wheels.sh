#!/usr/bin/env bash
# Run once, on a machine with pip and network, before tools/gpu/check.sh goes to a GPU
# machine that has neither: fetches into .whl/ (ignored by git, carried with the run) the
# wheels that machine's image lacks, for its Python 3.12 on x86-64. Its image already
# has numba, numba-cuda, cuda-bindings, torch, numpy, scipy, matplotlib, ml_dtypes,
# pytest and hypothesis (/work/.library/device/KINDS.md lists them). It needs NumPy 2.4:
# the image's NumPy (2.5.2 on 2026-11-26) removed np.row_stack, which its numba-cuda
# (0.30.4) still overloads at import, so every CUDA kernel failed to compile there; the
# carried wheel shadows it (tools/gpu/check.sh puts /tmp/site first on the path).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "numpy==2.4.6"
ls -l .whl
