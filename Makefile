# `make run`: set up and generate with vegas on the embedded SmolLM2 model.
# `make test`: set up and run the test suite (what CI runs).
.PHONY: setup run test test-gpu lint bench-cpu

setup:
	@bash scripts/setup.sh

# Its prompt, about 900 tokens of essays and a sentence for the model to finish
# (scripts/essay.py), is longer than --min-tokens (256), the budget's floor: its drafts read a
# selection of the context, not all of it. About 25 s on a 2-core CPU.
run: setup
	.venv/bin/python scripts/essay.py --words 700 | .venv/bin/vegas generate --method vegas \
		--max-tokens 64 --stats --prompt-file -

# One worker a core, at most two, as many as the free memory holds (tests/conftest.py); each
# test file stays on one worker, so a file's model fixtures load once.
test: setup
	.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=15

# The tests that need CUDA (CI has no GPU, where they skip): every kernel compiled, the real
# model's lossless and exact checks, the engine's graphs, prefill and steps on the GPU, and
# tensor parallelism over NCCL (skipped below two GPUs).
# On a GPU machine whose Python already has torch, triton, transformers and pytest-xdist:
# `make test-gpu PYTHON=python3` (no set-up: nothing is installed).
PYTHON ?= .venv/bin/python
test-gpu:
	$(PYTHON) -m pytest -q -n 8 tests/kernels
	$(PYTHON) -m pytest -q -n 4 --dist loadfile tests/speculative/test_exact_gpu.py \
		tests/speculative/test_lossless_gpu.py tests/speculative/test_round.py \
		tests/models/test_gpt_oss.py tests/models/test_qwen3_moe.py tests/models/test_mxfp4.py
	$(PYTHON) -m pytest -q -n 8 tests/test_graphs.py tests/test_engine_prefill.py \
		tests/test_engine_steps.py tests/test_engine_generate.py tests/test_engine_exact.py \
		tests/speculative/test_adaptive.py -k "cuda or gpu or lossless or prefill or graph or exact"
	$(PYTHON) -m pytest -q tests/test_parallel.py -k nccl

lint: setup
	.venv/bin/ruff check vegas_spec tests benchmarks

bench-cpu: setup
	.venv/bin/vegas bench --device cpu --workload essays --context 2k,7.5k --batch 4 \
		--max-tokens 64 --methods vanilla,vegas,lastq,stream,quest,specextend,full \
		--out benchmarks/results/cpu_methods
