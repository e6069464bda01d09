"""Records Apache MXNet 1.9.1's Adam over 1,000 steps of a warm-up CosineScheduler: a new
learning rate at every step, each handed to ``adam_update`` as a decimal string, which MXNet's
parser does not always round to the nearest float32 (about 1 rate in 100 comes out an ulp off).

Run with MXNet's own venv (no JAX there; it needs no network):

    "$(bash conformance/setup_mxnet.sh)" conformance/record_adam_rates.py

It writes conformance/data/mxnet_adam_rates.json, which tests/test_embedding_loop.py reads: the
gradients of each step (a seeded 8-element draw), the weight every 100 steps, through
``mx.kv.create('local')`` with ``kv.set_optimizer``, and the float32 learning rate
``adam_update`` used at each step (``lr_t`` worked out as MXNet's ``Adam.update`` does, handed to
``adam_update`` on a zero weight with ``beta1 = beta2 = epsilon = 0`` and a gradient of 1, whose
new weight is then ``-lr_t`` as parsed).
"""

from __future__ import annotations

import json
import math
import os

import mxnet as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, SIZE = 1000, 8


def main() -> None:
    rng = np.random.default_rng(7)
    grads = rng.normal(size=(STEPS, SIZE)).astype(np.float32)
    kv = mx.kv.create("local")
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=STEPS, base_lr=0.01, final_lr=1e-4, warmup_steps=5, warmup_begin_lr=1e-3
    )
    kv.set_optimizer(mx.optimizer.Adam(learning_rate=None, lr_scheduler=sched, wd=1e-4))
    kv.init(0, mx.nd.ones((SIZE,)))
    out = mx.nd.zeros((SIZE,))
    weights = []
    for step in range(STEPS):
        kv.push(0, mx.nd.array(grads[step]))
        if (step + 1) % 100 == 0:
            kv.pull(0, out=out)
            weights.append(out.asnumpy().tolist())
    sched = mx.lr_scheduler.CosineScheduler(
        max_update=STEPS, base_lr=0.01, final_lr=1e-4, warmup_steps=5, warmup_begin_lr=1e-3
    )
    rates = []
    for t in range(1, STEPS + 1):
        lr = sched(t) * math.sqrt(1.0 - 0.999**t) / (1.0 - 0.9**t)
        w = mx.nd.adam_update(
            mx.nd.zeros((1,)),
            mx.nd.ones((1,)),
            mx.nd.zeros((1,)),
            mx.nd.zeros((1,)),
            lr=lr,
            beta1=0.0,
            beta2=0.0,
            epsilon=0.0,
            wd=0.0,
        )
        rates.append(-float(w.asnumpy()[0]))
    path = os.path.join(HERE, "data", "mxnet_adam_rates.json")
    with open(path, "w") as f:
        json.dump(
            {
                "mxnet": mx.__version__,
                "gradients": grads.tolist(),
                "weights": weights,
                "rates": rates,
            },
            f,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
