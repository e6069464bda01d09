"""Records Apache MXNet 1.9.1's 2-bit gradient compression results for tests/test_compression.py.

Run with MXNet's own venv:  "$(bash conformance/setup_mxnet.sh)" conformance/record_compression.py
It prints one JSON object. A `device` store over D cpu contexts; device d pushes g * (d + 1) for
each g in G, with the default (assign) updater or `stored += input * 2`, and every pull is
recorded (all elements are equal, so one number per pull). It also records which compression
parameters and store types MXNet refuses.
"""

import json

import mxnet as mx

G = [0.3, 0.3, -0.7, 1.2, 0.05, -2.0]


def add2(key, inp, stored):
    stored += inp * 2


def run(devices, threshold, updater):
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init(3, mx.nd.zeros((2, 3)))
    if updater == "add2":
        kv._set_updater(add2)
    pulls = []
    for g in G:
        kv.push(3, [mx.nd.ones((2, 3), mx.cpu(d)) * g * (d + 1) for d in range(devices)])
        out = mx.nd.zeros((2, 3))
        kv.pull(3, out=out)
        pulls.append(float(out.asnumpy()[0, 0]))
    return pulls


def refused(store_type, params):
    try:
        mx.kv.create(store_type).set_gradient_compression(params)
    except Exception as e:  # MXNet raises MXNetError or a plain Exception
        return str(e).strip().splitlines()[-1]
    return None


def main():
    out = {"G": G, "pulls": {}, "refusals": {}}
    for devices in (2, 4):
        for threshold in (0.5, 0.25):
            for updater in ("assign", "add2"):
                out["pulls"][f"{devices} {threshold} {updater}"] = run(devices, threshold, updater)
    for store_type, params in [
        ("device", {"type": "2bit", "threshold": -0.5}),
        ("device", {"type": "2bit", "threshold": 0}),
        ("device", {"type": "1bit", "threshold": 0.5}),
        ("local", {"type": "2bit", "threshold": 0.5}),
    ]:
        out["refusals"][f"{store_type} {params}"] = refused(store_type, params)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
