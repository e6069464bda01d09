#!/usr/bin/env bash
# `make wheel-check`: build the sdist and the wheel (python -m build: the wheel is built from the
# sdist), check that the wheel holds every module of jaxkv/ and py.typed, install it without -e
# into a fresh venv in a temporary directory, and run the README's ```python examples with it
# from a directory outside the source tree. Catches files the sdist or the wheel leaves out.
#
# Usage: tools/wheel_check.sh [PYTHON]
#   PYTHON: an interpreter with the `build` package (the test extra has it); default python3.
#   The fresh venv is made with the same interpreter. KEEP=1 keeps the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${1:-python3}
tmp=$(mktemp -d -t jaxkv-wheel.XXXXXX)
if [ "${KEEP:-0}" = 1 ]; then echo "wheel-check: keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi

echo "wheel-check: python -m build (sdist, then the wheel from it)"
if ! "$py" -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1; then
    tail -n 40 "$tmp/build.log"
    exit 1
fi
wheel=$(ls "$tmp"/dist/jaxkv-*.whl)
ls "$tmp"/dist/jaxkv-*.tar.gz >/dev/null
echo "wheel-check: built $(cd "$tmp/dist" && ls | tr '\n' ' ')"

# Every file of the package in the source tree (as git knows it, in a clone) is in the wheel.
files=$(git ls-files -- jaxkv 2>/dev/null || true)
"$py" - "$wheel" "$files" <<'PY'
import pathlib, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = set(sys.argv[2].split()) or {
    p.as_posix()
    for p in pathlib.Path("jaxkv").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
}
want.add("jaxkv/py.typed")
missing = sorted(want - names)
if missing:
    sys.exit(f"wheel-check: the wheel lacks {missing}")
print(f"wheel-check: the wheel holds all {len(want)} files of jaxkv/, py.typed among them")
PY

echo "wheel-check: installing the wheel (not editable) into a fresh venv"
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "$wheel"

# The README's examples, from outside the source tree, with nothing of it on sys.path. The tests
# get 8 CPU devices from the root conftest.py; here XLA_FLAGS gives them. Dtype promotion is
# JAX's default here (the tests run strict): what a user gets.
mkdir "$tmp/run"
cd "$tmp/run"
env -u PYTHONPATH XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=8" \
    "$tmp/venv/bin/python" - "$root/README.md" <<'PY'
import doctest, importlib.metadata, pathlib, re, sys

import jaxkv

where = pathlib.Path(jaxkv.__file__).resolve().parent
assert where.is_relative_to(pathlib.Path(sys.prefix).resolve()), f"jaxkv imported from {where}"
assert (where / "py.typed").is_file(), "py.typed is not installed"
assert jaxkv.__version__ == importlib.metadata.version("jaxkv"), jaxkv.__version__
print(f"wheel-check: jaxkv {jaxkv.__version__} from {where}")

readme = pathlib.Path(sys.argv[1]).read_text()
blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.M | re.S)
if not blocks:
    sys.exit("wheel-check: no ```python blocks in README.md")
pathlib.Path("quickstart.md").write_text("\n".join(blocks))
failed, tried = doctest.testfile("quickstart.md", module_relative=False)
print(f"wheel-check: README examples: {tried} tried in {len(blocks)} blocks, {failed} failed")
sys.exit(1 if failed or not tried else 0)
PY
