"""Records what Apache MXNet 1.9.1 gives for values pushed into a key of another dtype, for
tests/test_odd_values.py.

Run with MXNet's own venv:  "$(bash conformance/setup_mxnet.sh)" conformance/record_casts.py
It prints one JSON object: for each store type (``local``, ``device``), number of devices (1, 2),
key dtype and value dtype, each value of VALUES pushed from every device (device d pushes the
value as it is) into a key initialised to zeros, and the pull after it: MXNet casts every
pushed value to the key's dtype (C's cast: a float into an integer truncates toward zero through
a 32-bit integer and keeps the low bits), then sums in the key's dtype. Where MXNet fails
instead (its error's last line is recorded in place of the pull), jaxkv.mx refuses.
"""

import json

import mxnet as mx
import numpy as np

VALUES = [0.0, 1.7, -1.7, 2.5, 127.9, 200.0, 255.0, 300.0, -1.0, -129.5, 70000.0, 1e6]
KEY_DTYPES = ["uint8", "int8", "int32", "float16", "float32"]
VALUE_DTYPES = ["float32", "float16", "int32", "uint8"]


def pushed(store, devices, key_dtype, value_dtype):
    kv = mx.kv.create(store)
    kv.init(0, mx.nd.zeros((len(VALUES),), dtype=key_dtype))
    given = np.array(VALUES, dtype=np.float32).astype(value_dtype)
    kv.push(0, [mx.nd.array(given, mx.cpu(d), dtype=value_dtype) for d in range(devices)])
    out = mx.nd.zeros((len(VALUES),), dtype=key_dtype)
    kv.pull(0, out=out)
    return [float(x) for x in out.asnumpy().astype(np.float64)]


def main():
    out = {"values": VALUES, "pulls": {}}
    for store in ("local", "device"):
        for devices in (1, 2):
            for key_dtype in KEY_DTYPES:
                for value_dtype in VALUE_DTYPES:
                    if key_dtype != value_dtype:
                        name = f"{store} {devices} {key_dtype} {value_dtype}"
                        try:
                            out["pulls"][name] = pushed(store, devices, key_dtype, value_dtype)
                        except mx.base.MXNetError as e:
                            out["pulls"][name] = str(e).strip().splitlines()[-1][:200]
    print(json.dumps(out, indent=1, allow_nan=True))


if __name__ == "__main__":
    main()
