#!/usr/bin/env bash
# jaxkv on an accelerator: which device JAX finds, the test suite with it as JAX's default
# backend, and the benchmark's ResNet-50 functional and in-jit rows. Run from a fresh clone:
#   bash benchmarks/gpu_check.sh
# Environment:
#   GPU_CHECK_CPU_OK=1       run even where JAX finds no accelerator (to check this script)
#   GPU_CHECK_SKIP_TESTS=1, GPU_CHECK_SKIP_BENCH=1   skip the tests, the benchmark
#   GPU_CHECK_PYTEST_ARGS    pytest's arguments (default: the suite but tests/test_dist.py)
#   GPU_CHECK_TIMEOUT        seconds each of the tests and the benchmark may run (default 270)
#   OUT                      where logs, the tests' JUnit XML and the benchmark report go
# The setup installs from PyPI (the project, and jax[cuda12] where nvidia-smi exists and the
# venv lacks jax_cuda12_plugin). The suite takes about 5 minutes on 2 CPU cores: where one
# command may run 10 minutes, run the tests and the benchmark as two (GPU_CHECK_SKIP_*).
#
# Where things run. conftest.py asks JAX for 8 simulated CPU devices, and the tests take
# jax.devices() to be those 8. Here the tests run with JAX_PLATFORMS=<accelerator>,cpu: the
# accelerator is JAX's default backend, so jax.devices() and every store without explicit
# devices live on it, and jax.devices("cpu") still gives the 8 CPU devices. Tests that need 8
# devices from jax.devices() fail on a single accelerator (the `devices` fixture says "tests
# expect 8 simulated CPU devices"); every other failure is a finding. The multi-process tests
# (tests/test_dist.py) are left out (`make test` runs them on CPU). The benchmark runs as it is
# (`bench.py --quick`), with the accelerator as its default backend.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t jaxkv-gpu-check.XXXX)}
mkdir -p "$OUT"
LIMIT=${GPU_CHECK_TIMEOUT:-270}
say() { printf '\n== %s\n' "$*"; }

say "setup: .venv (make .venv/.installed)"
make -s .venv/.installed
PY=.venv/bin/python
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  if ! $PY -c 'import jax_cuda12_plugin' 2>/dev/null; then
    JAXVER=$($PY -c 'import jax; print(jax.__version__)')
    .venv/bin/pip install -q "jax[cuda12]==$JAXVER"
  fi
fi

say "devices JAX finds"
$PY -c 'import jax; print("default backend:", jax.default_backend()); print(jax.devices())'
BACKEND=$($PY -c 'import jax; print(jax.default_backend())' 2>/dev/null)
case "$BACKEND" in
  gpu) if command -v nvidia-smi >/dev/null; then ACCEL=cuda; else ACCEL=rocm; fi ;;
  cpu)
    if [[ "${GPU_CHECK_CPU_OK:-0}" != 1 ]]; then
      echo "no accelerator found (set GPU_CHECK_CPU_OK=1 to run this script on CPU)" >&2
      exit 1
    fi
    ACCEL=cpu ;;
  *) ACCEL=$BACKEND ;;
esac
PLATFORMS=$ACCEL,cpu
[[ $ACCEL == cpu ]] && PLATFORMS=cpu

TESTS="skipped (GPU_CHECK_SKIP_TESTS=1)"
if [[ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]]; then
  say "tests: JAX_PLATFORMS=$PLATFORMS (default backend $ACCEL; jax.devices('cpu'): 8 simulated)"
  # tests/test_dist.py starts jobs of several processes, which would share the one accelerator.
  read -r -a PYTEST_ARGS <<<"${GPU_CHECK_PYTEST_ARGS:---ignore=tests/test_dist.py}"
  set +e
  JAX_PLATFORMS=$PLATFORMS timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$OUT/tests-$ACCEL.xml" "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/tests-$ACCEL.log"
  TESTS="pytest exit ${PIPESTATUS[0]}, log $OUT/tests-$ACCEL.log"
  set -e
  # Failures split: those that need 8 devices from jax.devices(), and the rest (the findings).
  $PY - "$OUT/tests-$ACCEL.xml" >"$OUT/tests-$ACCEL-failures.txt" <<'PY' || true
import sys, xml.etree.ElementTree as ET
need8, other = [], []
for case in ET.parse(sys.argv[1]).iter("testcase"):
    for bad in [*case.iter("failure"), *case.iter("error")]:
        text = (bad.get("message") or "") + (bad.text or "")
        name = f"{case.get('classname')}::{case.get('name')}"
        (need8 if "tests expect 8 simulated CPU devices" in text else other).append(name)
print(f"{len(need8)} failed needing 8 devices from jax.devices(), {len(other)} other failures")
if other:
    print("\n".join(other))
PY
fi

BENCH="skipped (GPU_CHECK_SKIP_BENCH=1)"
if [[ "${GPU_CHECK_SKIP_BENCH:-0}" != 1 ]]; then
  say "benchmark: bench.py --quick, default backend $ACCEL"
  REPORT=(benchmarks/results.md benchmarks/results.png)  # the committed CPU report
  CLEAN=$(git diff --quiet -- "${REPORT[@]}" && echo 1 || echo 0)
  set +e
  JAX_PLATFORMS=$PLATFORMS timeout "$LIMIT" $PY benchmarks/bench.py --quick 2>&1 \
    | tee "$OUT/bench-$ACCEL.log"
  BENCH="exit ${PIPESTATUS[0]}, log $OUT/bench-$ACCEL.log"
  set -e
  if [[ $CLEAN == 1 ]] && ! git diff --quiet -- "${REPORT[@]}"; then
    cp "${REPORT[@]}" "$OUT/" && git checkout -q -- "${REPORT[@]}"  # this run's report: in $OUT
  fi
fi

say "summary"
echo "device:    $($PY -c 'import jax; print(jax.devices()[0].device_kind)' 2>/dev/null)"
echo "tests:     JAX_PLATFORMS=$PLATFORMS, $TESTS"
[[ -f "$OUT/tests-$ACCEL-failures.txt" ]] && sed 's/^/           /' "$OUT/tests-$ACCEL-failures.txt"
echo "benchmark: $BENCH"
echo "outputs:   $OUT"
