#!/bin/bash
# kvzip CPU vs llama.cpp on the same GGUFs, 2 threads, interleaved so that both see
# the same machine load (issue 17). Per model and round: llama-bench (pp512,
# pp2048; tg64 at depth 512 and 2048), then kvz_bench_cpu (prefill 512/2048,
# decode after 512/2048, with the decode memory bound from the quantized bytes
# per token), then, if given, an older kvz_bench_cpu binary (A/B of a change on
# the same load). `uptime` is logged before every run.
#
#   bench/llama_compare.sh LLAMA_BIN_DIR [NEW_KVZ_BENCH [OLD_KVZ_BENCH]]
#
# LLAMA_BIN_DIR holds llama-bench and its shared libraries (llama.cpp built
# CPU-only outside this repository, see bench/RESULTS.md). Environment: MODELS
# (space-separated GGUF paths; default SmolLM2-135M Q4_1 and Qwen2.5-Coder-0.5B
# Q4_K_M under models/), ROUNDS (default 2), THREADS (default 2). Output goes to
# stdout; run it from the repository root.
set -u
LB=${1:-}
if [ -z "$LB" ] || [ ! -x "$LB/llama-bench" ]; then
    echo "llama_compare: skipped: no llama-bench at '${LB}' (usage: bench/llama_compare.sh LLAMA_BIN_DIR [NEW_KVZ_BENCH [OLD_KVZ_BENCH]])"
    exit 0
fi
NEW=${2:-build/bin/kvz_bench_cpu}
OLD=${3:-}
if [ ! -x "$NEW" ]; then
    echo "llama_compare: no kvz_bench_cpu at '$NEW' (build first)" >&2
    exit 1
fi
if [ -n "$OLD" ] && [ ! -x "$OLD" ]; then
    echo "llama_compare: no old kvz_bench_cpu at '$OLD'" >&2
    exit 1
fi
MODELS=${MODELS:-"models/SmolLM2-135M-Instruct.Q4_1.gguf models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"}
ROUNDS=${ROUNDS:-2}
T=${THREADS:-2}
for m in $MODELS; do
    if [ ! -f "$m" ]; then
        echo "llama_compare: model '$m' not found (scripts/fetch-model)" >&2
        exit 1
    fi
done
export OMP_NUM_THREADS=$T OMP_WAIT_POLICY=passive

stamp() { echo "## $(date -u +%H:%M:%S) $1 | $(uptime | sed 's/.*load average/load average/')"; }
llama() {
    stamp "llama.cpp $(basename "$1")"
    LD_LIBRARY_PATH=$LB "$LB/llama-bench" -m "$1" -t "$T" -r 2 -p 512,2048 -n 0 2>&1 | grep -E '^\| |^build'
    LD_LIBRARY_PATH=$LB "$LB/llama-bench" -m "$1" -t "$T" -r 2 -p 0 -n 64 -d 512,2048 2>&1 | grep -E '^\| .*tg'
}
kvz() {
    stamp "kvzip $2 $(basename "$1")"
    "$3" --model "$1" --no-ingest --no-baseline 2>/dev/null | grep -E '^\| (prefill|decode)|^bounds'
}
for m in $MODELS; do
    for r in $(seq 1 "$ROUNDS"); do
        echo "# round $r, $(basename "$m")"
        llama "$m"
        kvz "$m" new "$NEW"
        [ -n "$OLD" ] && kvz "$m" old "$OLD"
    done
done
stamp end
