#!/usr/bin/env bash
# The GPU tier (tests/gpu) in one command on a machine with a CUDA device, offline: the reference
# engine in bf16 on the GPU with layerkv's connector over the embedded store (pinned staging,
# side-stream copies), the oracle against local compute, faults, TTFT figures. Needs python3
# with torch (CUDA), numpy, xxhash, pytest, pytest-timeout, safetensors and tqdm; blake3 and
# cryptography come from .whl/ when missing (scripts/gpu_wheels.sh fetches them elsewhere).
# layerkv is not installed: it runs from src/. Prints a summary; files go to $OUT (or
# /tmp/layerkv-gpu). LAYERKV_GPU_DEVICE=cpu runs the same tests on the host (a dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-/tmp/layerkv-gpu}
mkdir -p "$out"
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "numpy", "xxhash", "pytest", "pytest_timeout", "safetensors", "tqdm", "blake3", "cryptography") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    if ! ls .whl/*.whl > /dev/null 2>&1; then
        echo "gpu_check: missing $missing and no .whl/ (run scripts/gpu_wheels.sh where pip works, carry .whl)"; exit 2
    fi
    site=$(mktemp -d /tmp/layerkv-site.XXXXXX)
    trap 'rm -rf "$site"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 2
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch; print("gpu_check: python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
report=$out/gpu-report.jsonl
rm -f "$report"
start=$(date +%s)
# env -u CI: the tier starts no Mooncake process and opens no socket (embedded store), so the
# suite's rule that CI runs inside a loopback-only network namespace does not apply to it
LAYERKV_GPU_REPORT=$report timeout 480 env -u CI "$PY" -m pytest -q -p no:cacheprovider tests/gpu -s --junitxml="$out/gpu-junit.xml" > "$out/gpu-pytest.log" 2>&1
rc=$?
grep -vE '^(INFO|WARNING)' "$out/gpu-pytest.log" | tail -40
echo "gpu_check: pytest exit $rc after $(( $(date +%s) - start )) s; $(grep -E '[0-9]+ (passed|failed)' "$out/gpu-pytest.log" | tail -1)"
[ -f "$report" ] && sed "s/^/gpu_check: figures /" "$report"
exit $rc
