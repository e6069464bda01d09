"""Records what Apache MXNet 1.9.1 does with Python updaters, for tests/test_per_key.py.

Run with MXNet's own venv:  "$(bash conformance/setup_mxnet.sh)" conformance/record_updaters.py
It prints one JSON object:
- ``shrinking``: an updater whose step shrinks with a Python counter (``stored -= recv / n`` on
  the n-th call), four pushes of ones to one key, the pull after each;
- ``printing``: the tutorial's printing updater (``stored += input * 2``), three pushes of ones
  to key 3 (initialised to 2), then a list push of keys 5, 7, 9: every line it printed, and the
  pulls;
- ``per_device``: the counter updater over a push of 4 devices' values (it sees their sum, once
  per push).
"""

import contextlib
import io
import json

import mxnet as mx


def shrinking_run(devices):
    kv = mx.kv.create("local")
    kv.init(0, mx.nd.zeros((2,)))
    calls = []

    def shrinking(key, recv, stored):
        calls.append((key, recv.asnumpy().tolist()))
        stored -= recv / len(calls)

    kv._set_updater(shrinking)
    out = mx.nd.zeros((2,))
    pulls = []
    for _ in range(4):
        kv.push(0, [mx.nd.ones((2,), mx.cpu(d)) for d in range(devices)])
        kv.pull(0, out=out)
        pulls.append(out.asnumpy().tolist())
    return {"pulls": pulls, "calls": calls}


def printing_run():
    kv = mx.kv.create("local")
    kv.init(3, mx.nd.ones((2, 3)) * 2)

    def update(key, input, stored):
        print("update on key: %d" % key)  # noqa: UP031  (the tutorial's line)
        stored += input * 2

    kv._set_updater(update)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in range(3):
            kv.push(3, mx.nd.ones((2, 3)))
        keys = [5, 7, 9]
        kv.init(keys, [mx.nd.ones((2, 3))] * 3)
        kv.push(keys, [mx.nd.ones((2, 3))] * 3)
    a = mx.nd.zeros((2, 3))
    kv.pull(3, out=a)
    b = mx.nd.zeros((2, 3))
    kv.pull(7, out=b)
    return {
        "printed": printed.getvalue().splitlines(),
        "key3": a.asnumpy().tolist(),
        "key7": b.asnumpy().tolist(),
    }


if __name__ == "__main__":
    print(
        json.dumps(
            {
                "mxnet": mx.__version__,
                "shrinking": shrinking_run(1),
                "per_device": shrinking_run(4),
                "printing": printing_run(),
            },
            indent=1,
        )
    )
