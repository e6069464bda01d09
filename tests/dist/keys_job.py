"""The last process pushes another key of the same shape than the others, functionally: where
the pushes meet in one sum, every process raises SumError at its next collective, naming its
own key (the checks of the sums compare the digests of the keys); where they do not, the
watchdog ends the job (20 s here). See tests/test_dist.py."""

import os

os.environ.setdefault("JAXKV_COLLECTIVE_TIMEOUT", "20")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
import jaxkv.mx as mx  # noqa: E402


def main():
    rank, workers = jax.process_index(), jax.process_count()
    local = jax.local_devices()
    kv = mx.kv.create("dist_sync")
    # Keys added one at a time keep arrays of their own: a push of either is the computation
    # of its shape.
    state = jaxkv.init(jaxkv.empty(jax.devices()), {"a": np.zeros(3, np.float32)})
    state = jaxkv.init(state, {"b": np.zeros(3, np.float32)})
    theirs = "b" if rank == workers - 1 else "a"
    try:
        state = jaxkv.push(state, theirs, jax.device_put(np.ones(3, np.float32), local[0]))
        kv.barrier()  # (the job's last collective: the processes' stores now differ)
    except jaxkv.SumError as e:
        assert f"key '{theirs}'" in str(e) and "different keys" in str(e), e
        print(f"rank {rank} ok another key on one process refused everywhere", flush=True)
    else:
        raise AssertionError("a push of another key on one process was not refused")
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
