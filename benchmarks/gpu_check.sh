#!/usr/bin/env bash
# jaxkv on an accelerator, in under 5 minutes: which device JAX finds, the whole test suite with
# it as JAX's default backend, and the benchmark's one-device sections (bench.py --only gpu,
# then --only proxy). Run from a clone, on a machine with no network:
#   GPU_CHECK_PYTHON=python3 bash benchmarks/gpu_check.sh
#
# Python. GPU_CHECK_PYTHON names a Python that already has JAX (with its accelerator plugin),
# optax, chex, orbax-checkpoint, pytest, pytest-xdist and hypothesis (torch is optional: the gpu
# section's PyTorch rows): nothing is installed, and it runs with PYTHONPATH=<repository root>
# so that `import jaxkv` finds this tree. Without it, the script sets up .venv as `make test`
# does (from PyPI: the project, jax[cuda12] where nvidia-smi exists and the venv lacks
# jax_cuda12_plugin, and pytest-xdist).
#
# Where things run. The tests run with JAX_PLATFORMS=<accelerator>,cpu: the accelerator is
# JAX's default backend (jax.devices() and every store without explicit devices live on it),
# and jax.devices("cpu") still gives the 8 simulated CPU devices (conftest.py), which every
# test that needs several devices names explicitly. So nothing needs 8 devices from
# jax.devices(): every failure is a finding, and the goal is "0 other failures" (a failure of
# the `devices` fixture, which asks for 8 CPU devices, is counted apart). tests/test_accelerator.py
# runs here (it is skipped, with its reason, on a machine without an accelerator). Processes the
# tests launch (multi-process jobs on gloo, the demo, the notebook's kernel) run on CPU
# (JAX_PLATFORMS=cpu, tests/_jobs.py). pytest-xdist runs the suite in GPU_CHECK_WORKERS
# processes (default: half the cores, at most 8) sharing the accelerator
# (XLA_PYTHON_CLIENT_PREALLOCATE=false), with pytest-benchmark's plugin off (-p no:benchmark:
# under xdist its warning is an error through filterwarnings = error). The summary splits
# the failures from the JUnit XML and lists every skipped test with its reason.
#
# Time. Each step has a limit, and no step runs past the script's budget (GPU_CHECK_BUDGET,
# default 290 s): the tests 165 s (interrupted with SIGINT, so pytest still reports what ran),
# each benchmark section 50 s. A benchmark section that fails or runs out of time is reported;
# it does not stop the script.
#
# Environment:
#   GPU_CHECK_PYTHON         the Python to use as it is (see above); default: .venv
#   GPU_CHECK_CPU_OK=1       run even where JAX finds no accelerator (to check this script)
#   GPU_CHECK_SKIP_TESTS=1, GPU_CHECK_SKIP_BENCH=1   skip the tests, the benchmark
#   GPU_CHECK_PYTEST_ARGS    pytest's arguments (default: the whole suite)
#   GPU_CHECK_WORKERS        pytest-xdist's worker count (0: no xdist)
#   GPU_CHECK_TEST_TIMEOUT   seconds the tests may run (default 165)
#   GPU_CHECK_BENCH_TIMEOUT  seconds each benchmark section may run (default 50)
#   GPU_CHECK_BENCH_STEPS    timed steps per round of the benchmark sections (default 100)
#   GPU_CHECK_BUDGET         seconds for the whole script (default 290)
#   OUT                      where logs, the tests' JUnit XML and their summary go
# Exit status: 0 when the tests ran to the end with no failure but the `devices` fixture's,
# else 1. The benchmark's status is reported only.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$(mktemp -d -t jaxkv-gpu-check.XXXX)}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET:-290}
say() { printf '\n== %s (%d s)\n' "$*" "$SECONDS"; }
# The seconds a step may run: its own limit, or what is left of the budget if that is less.
limit() {
  local left=$((BUDGET - SECONDS))
  ((left < 1)) && left=1
  echo $(($1 < left ? $1 : left))
}

if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then
  say "setup: $GPU_CHECK_PYTHON as it is, PYTHONPATH=$ROOT (nothing installed)"
  PY=$GPU_CHECK_PYTHON
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  say "setup: .venv (make .venv/.installed)"
  make -s .venv/.installed
  PY=.venv/bin/python
  if command -v nvidia-smi >/dev/null && ! $PY -c 'import jax_cuda12_plugin' 2>/dev/null; then
    JAXVER=$($PY -c 'import jax; print(jax.__version__)')
    .venv/bin/pip install -q "jax[cuda12]==$JAXVER"
  fi
  $PY -c 'import xdist' 2>/dev/null || .venv/bin/pip install -q pytest-xdist
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
$PY - <<'PY' || true
import importlib.metadata as md
import sys
names = ["jax", "jaxlib", "optax", "chex", "orbax-checkpoint", "pytest", "pytest-xdist",
         "hypothesis", "torch"]
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} absent")
print(f"python {sys.version.split()[0]}: " + ", ".join(found))
PY

say "devices JAX finds"
PROBE=$(timeout "$(limit 60)" $PY -c '
import jax
print(jax.default_backend(), jax.devices()[0].device_kind, sep="\n")
print(jax.devices())') || { echo "JAX did not start with $PY (see above)" >&2; exit 1; }
{ read -r BACKEND; read -r DEVICE; read -r DEVICES; } <<<"$PROBE"
echo "default backend $BACKEND ($DEVICE): $DEVICES"
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
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the test workers share the accelerator

STATUS=0
TESTS="skipped (GPU_CHECK_SKIP_TESTS=1)"
if [[ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]]; then
  CORES=$(nproc 2>/dev/null || echo 2)
  WORKERS=${GPU_CHECK_WORKERS:-$((CORES / 2 < 1 ? 1 : (CORES / 2 > 8 ? 8 : CORES / 2)))}
  XDIST=()
  if ((WORKERS > 0)); then
    if $PY -c 'import xdist' 2>/dev/null; then
      XDIST=(-n "$WORKERS" --dist worksteal)
    else
      echo "pytest-xdist is not installed: the tests run in one process"
      WORKERS=0
    fi
  fi
  read -r -a PYTEST_ARGS <<<"${GPU_CHECK_PYTEST_ARGS:-}"
  LIMIT=$(limit "${GPU_CHECK_TEST_TIMEOUT:-165}")
  say "tests: JAX_PLATFORMS=$PLATFORMS, $WORKERS xdist workers, at most $LIMIT s"
  set +e
  JAX_PLATFORMS=$PLATFORMS timeout -s INT -k 20 "$LIMIT" $PY -m pytest -q -p no:cacheprovider \
    -p no:benchmark "${XDIST[@]}" -rfEs --junitxml="$OUT/tests-$ACCEL.xml" "${PYTEST_ARGS[@]}" \
    >"$OUT/tests-$ACCEL.log" 2>&1
  CODE=$?
  set -e
  tail -n 25 "$OUT/tests-$ACCEL.log"
  TESTS="pytest exit $CODE, log $OUT/tests-$ACCEL.log"
  if ((CODE == 124 || CODE == 137)); then
    TESTS="NOT FINISHED in $LIMIT s ($TESTS)"
    STATUS=1
  fi
  # What the JUnit XML holds: failures of the `devices` fixture (8 CPU devices), every other
  # failure (the findings; the goal is none), and each skipped test with its reason.
  $PY - "$OUT/tests-$ACCEL.xml" >"$OUT/tests-$ACCEL-summary.txt" <<'PY' || STATUS=1
import sys
import xml.etree.ElementTree as ET

try:
    cases = list(ET.parse(sys.argv[1]).iter("testcase"))
except (OSError, ET.ParseError) as e:
    print(f"no JUnit XML to read ({e})")
    sys.exit(1)
need8, other, skipped = [], [], []
for case in cases:
    name = f"{case.get('classname')}::{case.get('name')}"
    for bad in [*case.iter("failure"), *case.iter("error")]:
        text = (bad.get("message") or "") + (bad.text or "")
        (need8 if "tests expect 8 simulated CPU devices" in text else other).append(name)
    for skip in case.iter("skipped"):
        skipped.append(f"{name}: {skip.get('message') or skip.text or ''}".strip())
failed = {*need8, *other}
passed = len(cases) - len(failed) - len(skipped)
print(
    f"{len(need8)} failed needing 8 CPU devices from jax.devices('cpu'), "
    f"{len(other)} other failures (the goal: 0 other failures); "
    f"{passed} passed, {len(skipped)} skipped, of {len(cases)} run"
)
for name in other:
    print(f"  failed: {name}")
for line in skipped:
    print(f"  skipped: {line}")
sys.exit(1 if need8 or other else 0)
PY
fi

BENCH=()
if [[ "${GPU_CHECK_SKIP_BENCH:-0}" != 1 ]]; then
  for section in gpu proxy; do
    LIMIT=$(limit "${GPU_CHECK_BENCH_TIMEOUT:-50}")
    say "benchmark: bench.py --only $section, default backend $ACCEL, at most $LIMIT s"
    set +e
    JAX_PLATFORMS=$PLATFORMS timeout -k 10 "$LIMIT" $PY benchmarks/bench.py --only "$section" \
      --eager-steps "${GPU_CHECK_BENCH_STEPS:-100}" >"$OUT/bench-$section.log" 2>&1
    CODE=$?
    set -e
    tail -n 15 "$OUT/bench-$section.log"
    case $CODE in
      0) BENCH+=("$section: ok, log $OUT/bench-$section.log") ;;
      124 | 137) BENCH+=("$section: NOT FINISHED in $LIMIT s, log $OUT/bench-$section.log") ;;
      *) BENCH+=("$section: FAILED (exit $CODE), log $OUT/bench-$section.log") ;;
    esac
  done
else
  BENCH=("skipped (GPU_CHECK_SKIP_BENCH=1)")
fi

say "summary"
echo "device:    $DEVICE (JAX's default backend: $BACKEND)"
echo "tests:     JAX_PLATFORMS=$PLATFORMS, $TESTS"
[[ -f "$OUT/tests-$ACCEL-summary.txt" ]] && sed 's/^/           /' "$OUT/tests-$ACCEL-summary.txt"
for line in "${BENCH[@]}"; do echo "benchmark: $line"; done
echo "time:      $SECONDS s (budget $BUDGET s)"
echo "outputs:   $OUT"
exit $STATUS
