"""Row-sparse values and MXNet's optimizers through ``jaxkv.mx``, against Apache MXNet 1.9.1.

The expected outcomes were recorded from MXNet 1.9.1 by conformance/record_rows.py
(conformance/data/mxnet_rows.json): a few fixed programs in the conformance harness's format
(row-sparse ``init``, pushes of rows from several devices with overlapping ids,
``row_sparse_pull`` with repeated and unsorted int64 and float32 ids, ``pull`` with
``ignore_sparse``, SGD lazy and standard, Adam lazy then standard). Each program runs here
through the harness's runner on jaxkv and is compared op by op by the harness's own comparison
(conformance/harness.py): every op must agree with MXNet bit for bit (optimizer values too),
except the ops the recording marks with a documented difference (``expect`` or ``differs``),
where the harness must find exactly that difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import jaxkv.mx as mx

CONFORMANCE = Path(__file__).parent.parent / "conformance"
sys.path.insert(0, str(CONFORMANCE))

import harness  # noqa: E402
import run_program  # noqa: E402

RECORDED = json.loads((CONFORMANCE / "data" / "mxnet_rows.json").read_text())
CASES = list(zip(RECORDED["programs"], RECORDED["outcomes"]))


def test_the_recording_is_mxnet_1_9_1():
    assert RECORDED["mxnet_version"] == "1.9.1"
    # Every documented difference the recording expects is one the harness knows.
    marks = {op.get("expect") or op.get("differs") for p, _ in CASES for op in p["ops"]}
    assert marks - {None} == {"X1", "X2", "X6"}


@pytest.mark.parametrize("program, recorded", CASES, ids=[p["id"] for p, _ in CASES])
def test_jaxkv_gives_mxnets_outcomes(program, recorded):
    ops = run_program.Runner(mx).run(program)
    tally = harness.Tally()
    rows = harness.compare(program, {"ops": recorded}, {"ops": ops}, tally)
    for op, row in zip(program["ops"], rows):
        label = op.get("expect") or op.get("differs")
        what = f"op {row['op']} {json.dumps(op)}: MXNet {row['mxnet']}, jaxkv {row['jaxkv']}"
        if label is None or label == "X1":  # X1: the drop-in now refuses a dense out too
            assert row["verdict"] == "agree", what
        else:
            assert row["verdict"].startswith(f"known difference {label}"), (row["verdict"], what)
    assert not tally.disagreements
    assert tally.approx_close == 0  # no op is compared with a tolerance: bit for bit
