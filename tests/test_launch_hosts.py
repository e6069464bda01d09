"""Two hosts simulated on one machine: two network namespaces joined by a veth pair on a private
test subnet, each running ``python -m jaxkv.launch --nnodes 2 --node-rank R`` with the
coordinator on the first namespace's address. Gloo must bind to the veth's address (the host
name resolves to 127.0.0.1 here, which the other "host" cannot reach).

Needs root and ``ip`` (iproute2); skipped, with the reason, where namespaces cannot be made."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
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


@pytest.mark.parametrize("binding", ["route", "JAXKV_IFNAME"])
def test_two_hosts_agree_on_every_sum(two_hosts, binding):
    """Each host: 1 process x 2 devices; kvstore_job.py checks init from rank 0, pushes summed
    over both hosts' devices and a sharded value with SGD on every rank. ``route``: gloo binds to
    the address on the route to the coordinator; ``JAXKV_IFNAME``: to the named interface."""
    coordinator = f"{two_hosts[0]['addr']}:29500"
    procs = []
    for rank, host in enumerate(two_hosts):
        env = dict(os.environ)
        env.pop("JAXKV_IFNAME", None)
        if binding == "JAXKV_IFNAME":
            env["JAXKV_IFNAME"] = host["veth"]
        command = ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "jaxkv.launch"]
        command += ["--nnodes", "2", "--node-rank", str(rank), "--coordinator", coordinator]
        command += ["-n", "1", "--devices-per-process", "2"]
        command += [os.path.join(HERE, "dist", "kvstore_job.py"), "2"]
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out + err
        for check in ("init from rank 0", "push sums over workers", "sharded value with sgd"):
            assert f"rank {rank} ok {check}" in out
        assert f"rank {rank} done" in out
