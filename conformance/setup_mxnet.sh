#!/usr/bin/env bash
# Makes (once) a venv with Apache MXNet 1.9.1 under ${MXNET_VENV:-.venv-mxnet} (in the
# repository, beside .venv; `make clean` removes it), used by
# `make conformance` and by the MXNet baseline of `make bench`, and prints the path of its python.
# MXNet 1.9.1 needs numpy < 1.24, so it cannot share jaxkv's venv.
set -eu
V=${MXNET_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-mxnet}
if [ ! -f "$V/.ok" ]; then
  echo "conformance: installing MXNet 1.9.1 into $V (once)" >&2
  python3 -m venv "$V"
  "$V/bin/pip" install -q "mxnet==1.9.1" "numpy<1.24"
  touch "$V/.ok"
fi
echo "$V/bin/python"
