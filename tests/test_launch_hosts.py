"""Two hosts simulated on one machine: two network namespaces joined by a veth pair on a private
test subnet, each running ``python -m jaxkv.launch --nnodes 2 --node-rank R`` with the
coordinator on the first namespace's address: every rank agrees on every sum, and a job whose
rank dies on one host restarts on both. Gloo must bind to the veth's address (the host name
resolves to 127.0.0.1 here, which the other "host" cannot reach).

Needs root and ``ip`` (iproute2); skipped, with the reason, where namespaces cannot be made."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
from _jobs import cpu_env

HERE = os.path.dirname(os.path.abspath(__file__))
# The launched script, for the values of an uninterrupted run (its main() runs only when launched).
_spec = importlib.util.spec_from_file_location(
    "restart_job", os.path.join(HERE, "dist", "restart_job.py")
)
restart_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(restart_job)
TAG = os.getpid() % 10000
SUBNET = f"10.254.{os.getpid() % 250}"  # private (RFC 1918), one /24 per test run
HOSTS = [
    {"ns": f"jaxkv-{TAG}-a", "veth": f"jkv{TAG}a", "addr": f"{SUBNET}.1"},
    {"ns": f"jaxkv-{TAG}-b", "veth": f"jkv{TAG}b", "addr": f"{SUBNET}.2"},
]


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def remove_namespaces():
    for host in HOSTS:  # deleting a namespace deletes its end of the veth pair, and the pair
        subprocess.run(["ip", "netns", "del", host["ns"]], capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    try:
        for host in HOSTS:
            ip("netns", "add", host["ns"])
        a, b = HOSTS
        ip("link", "add", a["veth"], "type", "veth", "peer", "name", b["veth"])
        for host in HOSTS:
            ip("link", "set", host["veth"], "netns", host["ns"])
            ip("-n", host["ns"], "addr", "add", f"{host['addr']}/24", "dev", host["veth"])
            ip("-n", host["ns"], "link", "set", host["veth"], "up")
            ip("-n", host["ns"], "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        remove_namespaces()
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot make network namespaces here: {detail.strip()}")
    try:
        yield HOSTS
    finally:
        remove_namespaces()


def run_on_hosts(hosts, launcher_args, script, env=None):
    """Runs the launcher in each namespace (node rank = its index; coordinator on the first);
    returns each one's (returncode, stdout, stderr)."""
    coordinator = f"{hosts[0]['addr']}:29500"
    procs = []
    for rank, host in enumerate(hosts):
        command = ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "jaxkv.launch"]
        command += ["--nnodes", "2", "--node-rank", str(rank), "--coordinator", coordinator]
        command += [*launcher_args, *script]
        procs.append(
            subprocess.Popen(
                command,
                env=cpu_env(**(env(host) if env else {})),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_two_hosts_agree_on_every_sum(two_hosts, monkeypatch):
    """Each host: 1 process x 2 devices; kvstore_job.py checks init from rank 0, pushes summed
    over both hosts' devices and a sharded value with SGD on every rank. Gloo binds to the
    address on the route to the coordinator."""
    monkeypatch.delenv("JAXKV_IFNAME", raising=False)
    script = [os.path.join(HERE, "dist", "kvstore_job.py"), "2"]
    results = run_on_hosts(two_hosts, ["-n", "1", "--devices-per-process", "2"], script)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, out + err
        for check in ("init from rank 0", "push sums over workers", "sharded value with sgd"):
            assert f"rank {rank} ok {check}" in out
        assert f"rank {rank} done" in out


def test_two_hosts_restart_after_a_killed_rank(two_hosts, tmp_path):
    """With gloo bound by JAXKV_IFNAME: restart_job.py checkpoints with kv.save every 2 of 6
    steps, in a directory both hosts see; rank 1 (on the second host) SIGKILLs itself before
    step 3. Both launchers restart their share of the job (after JAX's heartbeat timeout, 10 s
    here, plus 5 s), which loads the checkpoint of step 2, redoes step 3, and ends with exactly
    the values of an uninterrupted run, momentum included."""
    pytest.importorskip("orbax.checkpoint")
    script = [os.path.join(HERE, "dist", "restart_job.py"), str(tmp_path), "6", "2", "1:kill@3"]
    results = run_on_hosts(
        two_hosts,
        ["-n", "1", "--devices-per-process", "1", "--max-restarts", "2"],
        script,
        env=lambda host: {"JAXKV_IFNAME": host["veth"], "JAXKV_HEARTBEAT_TIMEOUT": "10"},
    )
    want = restart_job.uninterrupted(6, processes=2, devices_per_process=1)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, out + err
        assert "restarting the job (restart 1 of 2)" in err, out + err
        assert f"rank {rank} attempt 0 starts at step 0" in out, out + err
        assert f"rank {rank} attempt 1 starts at step 2" in out, out + err
        assert f"rank {rank} final {want}" in out, out + err
