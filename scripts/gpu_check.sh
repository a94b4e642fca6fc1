#!/usr/bin/env bash
# One run on a fresh GPU machine (torch + nvcc, no network): build the extension in place for this
# machine's Python, self-check, GPU tests, compute-sanitizer (memcheck, racecheck) on small cases,
# benchmarks. Logs, JSON, markdown and plots go to the output folder ($1 or $OUT).
# Usage: bash scripts/gpu_check.sh OUTPUT_DIR
#   QUICK=1: shorter benchmark sweeps; STAGES="build test sanitize bench" (default: all) picks stages;
#   TESTS="pytest arguments" (default: tests -m gpu), SANITIZERS="memcheck racecheck",
#   BENCHES="gemm gemm_layer linear_logp attention model host_overhead" narrow a stage
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:?give an output folder as \$1 or \$OUT}}
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT_S CMD...: run, log, remember failure, keep going
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*" | tee -a "$log"
    local start=$SECONDS
    timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

stages=" ${STAGES:-build test sanitize bench} "
has() { [[ $stages == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$log"
if has build; then
    step build 420 python3 setup.py build_ext --inplace || { tail -50 "$log"; exit 1; }
    mkdir -p "$out/build"
    for obj in build/temp*/cuda/*.o; do
        name=$(basename "$obj" .o)
        cuobjdump --dump-sass "$obj" > "build/$name.sass" 2>/dev/null
        echo "$name SASS: $(grep -c HGMMA "build/$name.sass") HGMMA, $(grep -c HMMA "build/$name.sass") HMMA, $(grep -c -E 'LDL|STL' "build/$name.sass") local-memory instructions" | tee -a "$log"
    done
    tar czf "$out/build/ptxas-sass.tar.gz" build/temp*/cuda/*.ptxas.log build/*.sass 2>/dev/null
fi
if has test; then
    step self-check 300 python3 -m rl_kernels
    step gpu-tests 900 python3 -m pytest ${TESTS:-tests -m gpu} -q -rs --junitxml="$out/gpu-tests.xml"
fi
if has sanitize; then
    for tool in ${SANITIZERS:-memcheck racecheck}; do
        step "$tool" 300 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 scripts/sanitizer_cases.py
    done
fi
if has bench; then
    quick=${QUICK:+--quick}
    for bench in ${BENCHES:-gemm gemm_layer linear_logp attention model host_overhead}; do
        case $bench in model|host_overhead) args= ;; *) args=$quick ;; esac
        step "bench-$bench" 900 python3 "benchmarks/bench_$bench.py" $args
        tar czf "$out/results.tar.gz" benchmarks/results docs/benchmarks.md docs/plots 2>/dev/null
    done
fi
tar czf "$out/results.tar.gz" benchmarks/results docs/benchmarks.md docs/plots 2>/dev/null
grep -E "^=== .*exit|passed|failed|ERROR SUMMARY|geometric" "$log" | tail -40
exit "$status"
