#!/usr/bin/env bash
# BENCHMARKS.md §1, long generation on a GPU: the step profile (greedy and sampled rounds),
# `vegas bench --workload generation` greedy and sampled at the reference setting, and the
# selection sweep of vegas's local window, each writing under OUT (default ./long_generation).
#
#   bash benchmarks/long_generation.sh steps            # SmolLM2 and Llama-3.1-8B shapes
#   bash benchmarks/long_generation.sh long             # Llama-3.1-8B at 16 x 32K
#   bash benchmarks/long_generation.sh bench 32 3072    # batch, new tokens a sequence
#   bash benchmarks/long_generation.sh sweep 32 2048
#
# MODEL (default: the embedded SmolLM2) and VEGAS (default: `python -m vegas_spec.cli`) may be
# set; the run writes JSON and Markdown only (the bench's plots are removed).
set -euo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-long_generation}
VEGAS=${VEGAS:-python -m vegas_spec.cli}
MODEL_ARGS=()
if [ -n "${MODEL:-}" ]; then MODEL_ARGS=(--model "$MODEL"); fi
mkdir -p "$OUT"
part=${1:?steps, long, bench or sweep}
batch=${2:-32}
tokens=${3:-3072}
SAMPLED=(--temperature 0.6 --top-p 0.95 --top-k 20)

case "$part" in
steps)  # greedy and sampled rounds, drafts on the model's weights and on FP8 copies
    python step_profile.py --brief --reps 10 --gamma 6 --ratio 0.07 \
        --config configs/smollm2-135m --contexts 2048 4096 --batches 32 \
        --draft-weights model fp8 --out "$OUT/steps_smollm2.json"
    python step_profile.py --brief --reps 5 --gamma 6 --ratio 0.07 \
        --config configs/llama-3.1-8b --contexts 2048 8192 --batches 32 \
        --draft-weights model fp8 --out "$OUT/steps_8b_b32.json"
    ;;
long)  # the long-prompt shapes of the 8B models
    python step_profile.py --brief --reps 5 --gamma 6 --ratio 0.05 \
        --config configs/llama-3.1-8b --contexts 32768 --batches 16 \
        --draft-weights model fp8 --out "$OUT/steps_8b_32k.json"
    ;;
bench)
    for mode in greedy sampled; do
        extra=()
        if [ "$mode" = sampled ]; then extra=("${SAMPLED[@]}"); fi
        $VEGAS bench "${MODEL_ARGS[@]}" --device cuda --dtype bfloat16 --workload generation \
            --batch "$batch" --generation-tokens "$tokens" --methods vanilla,stream,vegas \
            --no-progress "${extra[@]}" ${BENCH_ARGS:-} --out "$OUT/gen_${mode}_b${batch}"
        rm -f "$OUT/gen_${mode}_b${batch}"/*.png
    done
    ;;
sweep)
    python selection_sweep.py "${MODEL_ARGS[@]}" --device cuda --dtype bfloat16 \
        --batch "$batch" --context 4096 --max-tokens "$tokens" \
        --workloads generation essays code --windows 0 32 64 --pools 1 \
        --out "$OUT/selection_sweep_b${batch}.json"
    ;;
*)
    echo "unknown part $part: steps, long, bench or sweep" >&2
    exit 2
    ;;
esac
