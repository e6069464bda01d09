"""Gradient compression across processes (``dist_sync``, 2 processes x 2 devices,
tests/dist/compression_job.py): 2-bit pulls equal Apache MXNet 1.9.1's ``dist_sync`` with 2
workers exactly (recorded in conformance/data/mxnet_dist_2bit.json: 1 and 2 devices per
worker, thresholds 0.5 and 0.25, values whole or split, SGD on the servers, dist_device_sync);
fp16 and bf16 send each process's sum in 16 bits; a compressed push writes at most 1/14 of the
bytes of an uncompressed one; a store with several devices per process is refused."""

import os

from _jobs import launch

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED = os.path.join(HERE, "..", "conformance", "data", "mxnet_dist_2bit.json")


def test_compression_across_processes_gives_mxnet_dist_syncs_values(tmp_path):
    run = launch(2, "compression_job.py", RECORDED, tmp_path / "ckpt", timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(2):
        assert f"rank {rank} ok refused" in run.stdout
        assert f"rank {rank} ok resumed from a checkpoint" in run.stdout
        for n in range(9):
            assert f"rank {rank} ok run {n} " in run.stdout, run.stdout
        for kind in ("fp16", "bf16"):
            assert f"rank {rank} ok {kind} sums of 16-bit values" in run.stdout
        assert f"rank {rank} ok bytes per push" in run.stdout
        assert f"rank {rank} done" in run.stdout
    # Where MXNet's servers decode with the threshold itself, its values exactly.
    assert run.stdout.count(" mxnet t=") == 2 * 7, run.stdout
