#!/usr/bin/env bash
# Every GPU check of the project in one command, within 10 minutes on one H100/H200 (6.5 on an H200 at 2026-11):
#   1. the environment: torch with CUDA, lightning, transformers, hydra-core, omegaconf, pytest-timeout and
#      this project importable; what is missing is named, and the script exits 2 before anything runs;
#   2. python -m pytest -m gpu tests/strategies/runtime/test_cuda_graphs.py tests/strategies/runtime/test_gpu.py (the first: strategy.cuda_graphs against
#      eager steps, well under a minute; all of them about 200 s on an H200): no test starts after
#      GPU_CHECK_TEST_TIMEOUT_S - 120 seconds (330 by default), none runs longer than 120 s, the whole stops at
#      GPU_CHECK_TEST_TIMEOUT_S;
#   3. python scripts/bench.py --parts gpu, the GPU benchmark (at most GPU_CHECK_BENCH_TIMEOUT_S, 240 by default;
#      160-195 s on an H200; its JSON is written after each model).
# With the environment check (seconds) and the summary, the limits add up to less than 10 minutes.
# Usage: bash scripts/gpu_check.sh OUT_DIR   (PYTHON=... picks the interpreter, python3 by default)
#        bash scripts/gpu_check.sh OUT_DIR checkpoint   the environment check, then only the checkpoint benchmark
#        (scripts/bench_checkpoint.py --gpu: saves in the foreground and in the background against none, at most
#        GPU_CHECK_CHECKPOINT_TIMEOUT_S, 300 by default) into OUT_DIR/bench_checkpoint.json: a second device call,
#        since the checks above fill the 10 minutes of one
# OUT_DIR receives four files: gpu_check.log (everything printed), pytest.xml (the JUnit report),
# bench_gpu.json (the benchmark's record) and summary.json (the tests' counts and failures with the record).
# Exit status: 0 when every test passed and the benchmark finished, 1 otherwise, 2 when the environment cannot
# run the checks.
set -uo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ] || { [ $# -eq 2 ] && [ "$2" != checkpoint ]; }; then
  echo "usage: bash scripts/gpu_check.sh OUT_DIR [checkpoint]" >&2
  exit 2
fi
out=$1
part=${2:-all}
PYTHON=${PYTHON:-python3}
test_timeout=${GPU_CHECK_TEST_TIMEOUT_S:-330}
bench_timeout=${GPU_CHECK_BENCH_TIMEOUT_S:-240}
session_timeout=$(( test_timeout > 150 ? test_timeout - 120 : 30 ))  # + one test's 120 s stays within test_timeout
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
log=$out/gpu_check.log
rm -f "$out/pytest.xml" "$out/bench_gpu.json" "$out/summary.json"
: > "$log"
cd "$root" || exit 2
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
began=$(date +%s)

say() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

say "environment ($PYTHON)"
"$PYTHON" - "$out" <<'EOF' 2>&1 | tee -a "$log"
import importlib.util, json, sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# module -> what to install; found without importing (torch is imported below, for CUDA)
needed = {"torch": "torch", "lightning": "lightning", "transformers": "transformers", "hydra": "hydra-core",
          "omegaconf": "omegaconf", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
          "pipeline_recipes": "this project (python -m pip install -e .)"}
missing, versions = [], {"python": sys.version.split()[0]}
for module, package in needed.items():
    try:
        found = importlib.util.find_spec(module) is not None
    except Exception:  # a broken package counts as missing
        found = False
    if not found:
        missing.append(package)
        continue
    try:
        versions[module] = version(package)
    except (PackageNotFoundError, ValueError):
        pass
if tuple(int(x) for x in versions.get("pytest_timeout", "9").split(".")[:2] if x.isdigit()) < (2, 3):
    missing.append(f"pytest-timeout>=2.3 (for --session-timeout; found {versions['pytest_timeout']})")
problems = []
if missing:
    problems.append("missing: " + ", ".join(missing) + ". Install them first (pip install hydra-core omegaconf "
                    "'pytest-timeout>=2.3' -e .; without network, from wheels downloaded elsewhere)")
if "torch" not in missing:
    import torch

    if torch.cuda.is_available():
        versions["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    else:
        problems.append(f"no CUDA: torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False); "
                        "the GPU checks need a machine with an NVIDIA GPU and a CUDA build of torch")
print("versions: " + json.dumps(versions))
if problems:
    for line in problems:
        print("gpu_check: " + line, file=sys.stderr)
    Path(sys.argv[1], "summary.json").write_text(json.dumps(
        {"ok": False, "environment": problems, "versions": versions}, indent=1) + "\n")
    sys.exit(2)
EOF
env_rc=${PIPESTATUS[0]}
if [ "$env_rc" -ne 0 ]; then
  grep '^gpu_check: ' "$log" >&2
  say "the environment cannot run the GPU checks (see above); nothing was run"
  exit 2
fi

if [ "$part" = checkpoint ]; then
  ckpt_timeout=${GPU_CHECK_CHECKPOINT_TIMEOUT_S:-300}
  say "checkpoint benchmark: python scripts/bench_checkpoint.py --gpu (at most ${ckpt_timeout}s)"
  timeout -k 10 "$ckpt_timeout" "$PYTHON" scripts/bench_checkpoint.py --gpu --out "$out/bench_checkpoint.json" 2>&1 \
    | tee -a "$log"
  ckpt_rc=${PIPESTATUS[0]}
  say "checkpoint benchmark: exit status $ckpt_rc in $(( $(date +%s) - began ))s"
  exit "$ckpt_rc"
fi

say "tests: python -m pytest -m gpu tests/strategies/runtime/test_cuda_graphs.py tests/strategies/runtime/test_gpu.py (at most ${test_timeout}s)"
# -o addopts: one process (the GPU tests share one card; the GPU machine has no pytest-xdist)
timeout -k 10 "$test_timeout" "$PYTHON" -m pytest -p no:cacheprovider -o addopts="-ra --strict-markers" -v -m gpu \
  tests/strategies/runtime/test_cuda_graphs.py tests/strategies/runtime/test_gpu.py \
  --timeout=120 --session-timeout=$session_timeout --durations=20 --junitxml="$out/pytest.xml" 2>&1 \
  | tee -a "$log"
test_rc=${PIPESTATUS[0]}
say "tests: exit status $test_rc$([ "$test_rc" -ge 124 ] && echo " (stopped at the time limit)")"

say "benchmark: python scripts/bench.py --parts gpu (at most ${bench_timeout}s)"
timeout -k 10 "$bench_timeout" "$PYTHON" scripts/bench.py --parts gpu --out "$out/bench_gpu.json" 2>&1 | tee -a "$log"
bench_rc=${PIPESTATUS[0]}
say "benchmark: exit status $bench_rc$([ "$bench_rc" -ge 124 ] && echo " (stopped at the time limit)")"

"$PYTHON" scripts/bench_gpu.py --summary "$out" "tests=$test_rc" "bench=$bench_rc" "wall_s=$(( $(date +%s) - began ))" \
  2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
say "done in $(( $(date +%s) - began ))s: $(ls "$out" | tr '\n' ' ')"
exit "$rc"
