#!/usr/bin/env bash
# One run on a fresh GPU machine (torch + nvcc, no network): build the extension in place for this
# machine's Python, self-check, GPU tests, compute-sanitizer (memcheck, racecheck) on small cases,
# benchmarks. Logs, JSON, markdown and plots go to the output folder ($1 or $OUT).
# Usage: bash scripts/gpu_check.sh OUTPUT_DIR      (QUICK=1: shorter benchmark sweeps)
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

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$log"
step build 420 python3 setup.py build_ext --inplace || { tail -50 "$log"; exit 1; }
cp build/temp*/cuda/*.ptxas.log "$out/" 2>/dev/null
for obj in build/temp*/cuda/*.o; do
    name=$(basename "$obj" .o)
    cuobjdump --dump-sass "$obj" > "$out/$name.sass" 2>/dev/null
    echo "$name: $(grep -c -E 'HGMMA' "$out/$name.sass") HGMMA, $(grep -c -E 'HMMA' "$out/$name.sass") HMMA, $(grep -c -E 'LDL|STL' "$out/$name.sass") local-memory instructions" | tee -a "$log"
done
step self-check 300 python3 -m rl_kernels
step gpu-tests 900 python3 -m pytest tests -m gpu -q -rs --junitxml="$out/gpu-tests.xml"
step memcheck 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitizer_cases.py
step racecheck 300 compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/sanitizer_cases.py
quick=${QUICK:+--quick}
step bench-gemm 900 python3 benchmarks/bench_gemm.py $quick
step bench-linear-logp 900 python3 benchmarks/bench_linear_logp.py $quick
step bench-host-overhead 300 python3 benchmarks/bench_host_overhead.py
tar czf "$out/results.tar.gz" benchmarks/results docs/benchmarks.md docs/plots 2>/dev/null
grep -E "^=== .*exit|passed|failed|ERROR SUMMARY|geometric" "$log" | tail -40
exit "$status"
