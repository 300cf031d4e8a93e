# `make run`: set up and generate with vegas on the embedded SmolLM2 model.
# `make test`: set up and run the test suite (what CI runs).
.PHONY: setup run test lint bench-cpu

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/vegas generate --chat --method vegas --max-tokens 64 --stats \
		--prompt "Explain in two sentences why decoding long contexts is memory-bound."

# Two workers, one per core of a 2-core CI machine; each test file stays on one worker, so
# a file's model fixtures load once.
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=15

lint: setup
	.venv/bin/ruff check vegas_spec tests benchmarks

bench-cpu: setup
	.venv/bin/vegas bench --device cpu --workload essays --context 2k,7.5k --batch 4 \
		--max-tokens 64 --methods vanilla,vegas,lastq,stream,quest,specextend,full \
		--out benchmarks/results/cpu_methods
