"""jaxkv/_src/processes/join.py: the job a process joins, read from the launcher's variables
and from SLURM's and Open MPI's, the coordinator's address, and each process's first device."""

import logging
import os
import sys
import types

import jax
import pytest

from jaxkv._src import jax_internals
from jaxkv._src.processes import join

# Every variable join.py reads: each test starts with none of them set.
_VARIABLES = (
    join.ENV_COORDINATOR,
    join.ENV_NUM_PROCESSES,
    join.ENV_PROCESS_ID,
    join.ENV_DEVICES_PER_PROCESS,
    join.ENV_RESTART_COUNT,
    join.ENV_IFNAME,
    join.ENV_HEARTBEAT_TIMEOUT,
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_heartbeat_timeout_is_the_variable_else_the_default(monkeypatch):
    assert join.heartbeat_timeout() == join.DEFAULT_HEARTBEAT_TIMEOUT
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "")  # empty: as if unset
    assert join.heartbeat_timeout() == join.DEFAULT_HEARTBEAT_TIMEOUT
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "7")
    assert join.heartbeat_timeout() == 7


def test_restart_count_is_zero_unless_the_launcher_set_it(monkeypatch):
    assert join.restart_count() == 0
    monkeypatch.setenv(join.ENV_RESTART_COUNT, "")
    assert join.restart_count() == 0
    monkeypatch.setenv(join.ENV_RESTART_COUNT, "3")
    assert join.restart_count() == 3


def test_split_address_takes_the_port_after_the_last_colon():
    assert join.split_address("node0:8476") == ("node0", 8476)
    assert join.split_address("10.0.0.2:1") == ("10.0.0.2", 1)
    # an IPv6 address has colons of its own: brackets around it, and they are dropped
    assert join.split_address("[fe80::1]:8476") == ("fe80::1", 8476)


@pytest.mark.parametrize("address", ["node0", ":8476", "node0:", "node0:84a", "node0:-1", ""])
def test_split_address_refuses_a_missing_host_or_port(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        join.split_address(address)


def test_the_route_to_a_coordinator_on_this_machine_starts_at_loopback():
    # a UDP "connect" sends nothing: no coordinator need listen there
    assert join.local_address("127.0.0.1:9") == "127.0.0.1"


def test_gloo_binds_to_the_named_interface_else_to_the_route_toward_the_coordinator(
    monkeypatch,
):
    assert join.gloo_binding("127.0.0.1:9") == {"hostname": "127.0.0.1"}
    monkeypatch.setenv(join.ENV_IFNAME, "")  # empty: as if unset
    assert join.gloo_binding("127.0.0.1:9") == {"hostname": "127.0.0.1"}
    monkeypatch.setenv(join.ENV_IFNAME, "eth7")
    assert join.gloo_binding("127.0.0.1:9") == {"interface": "eth7"}


def test_pin_gloo_registers_the_cpu_backend_or_warns_where_it_cannot(monkeypatch, caplog):
    import jax.extend.backend

    registered = []
    monkeypatch.setattr(
        jax.extend.backend,
        "register_backend_factory",
        lambda name, factory, **kw: registered.append((name, factory)),
    )
    backend = object()
    seen = []
    monkeypatch.setattr(
        jax_internals, "gloo_cpu_backend", lambda binding: seen.append(binding) or backend
    )
    assert join.pin_gloo({"interface": "eth7"}) is True
    assert seen == [{"interface": "eth7"}]
    assert registered == [("cpu", backend)]

    monkeypatch.setattr(jax_internals, "gloo_cpu_backend", lambda binding: None)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert join.pin_gloo({"interface": "eth7"}) is False
    assert registered == [("cpu", backend)]  # nothing more registered
    assert "gloo" in caplog.text


def test_an_uncaught_exception_reports_then_exits_with_status_1_even_if_reporting_fails(
    monkeypatch,
):
    calls = []

    def previous(kind, value, tb):
        calls.append(("report", kind, value))
        raise RuntimeError("the report itself failed")

    monkeypatch.setattr(sys, "excepthook", previous)
    monkeypatch.setattr(os, "_exit", lambda status: calls.append(("exit", status)))
    join.exit_on_uncaught_exception()
    error = ValueError("boom")
    with pytest.raises(RuntimeError, match="report itself"):
        sys.excepthook(ValueError, error, None)
    assert calls == [("report", ValueError, error), ("exit", 1)]


class _Distributed:
    """Stands in for ``jax.distributed``: records ``initialize``'s arguments."""

    def __init__(self, initialized=False):
        self.initialized = initialized
        self.calls = []

    def is_initialized(self):
        return self.initialized

    def initialize(self, **kwargs):
        self.calls.append(kwargs)
        self.initialized = True


@pytest.fixture
def fake_job(monkeypatch):
    """``jax.distributed``, ``jax.config.update``, gloo's pin and the exit hook, recorded."""
    dist = _Distributed()
    monkeypatch.setattr(jax.distributed, "is_initialized", dist.is_initialized)
    monkeypatch.setattr(jax.distributed, "initialize", dist.initialize)
    dist.config = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: dist.config.append((name, value)))
    dist.pinned = []
    monkeypatch.setattr(join, "pin_gloo", lambda binding: dist.pinned.append(binding) or True)
    dist.hooked = []
    monkeypatch.setattr(join, "exit_on_uncaught_exception", lambda: dist.hooked.append(True))
    # (a JAX before CACHE_HANGS_FROM: the compilation cache is left alone; tests below set it)
    monkeypatch.setattr(join, "_jax_release", lambda: (0, 11, 2))
    return dist


def test_a_process_the_launcher_did_not_start_joins_nothing(fake_job):
    join.join_launched_job()
    assert fake_job.calls == [] and fake_job.config == [] and fake_job.pinned == []


def test_a_launched_process_joins_with_the_launchers_numbers(monkeypatch, fake_job):
    monkeypatch.setenv(join.ENV_COORDINATOR, "127.0.0.1:9")
    monkeypatch.setenv(join.ENV_NUM_PROCESSES, "6")
    monkeypatch.setenv(join.ENV_PROCESS_ID, "4")
    monkeypatch.setenv(join.ENV_DEVICES_PER_PROCESS, "3")
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "11")
    monkeypatch.setenv(join.ENV_IFNAME, "eth7")
    join.join_launched_job()
    assert fake_job.calls == [
        {
            "coordinator_address": "127.0.0.1:9",
            "num_processes": 6,
            "process_id": 4,
            "heartbeat_timeout_seconds": 11,
        }
    ]
    assert ("jax_cpu_collectives_implementation", "gloo") in fake_job.config
    assert ("jax_num_cpu_devices", 3) in fake_job.config
    assert fake_job.pinned == [{"interface": "eth7"}]
    assert fake_job.hooked == [True]
    # once joined, a second call (join_cluster makes one) does nothing
    join.join_launched_job()
    assert len(fake_job.calls) == 1


def test_without_devices_per_process_jax_keeps_its_own_count(monkeypatch, fake_job):
    monkeypatch.setenv(join.ENV_COORDINATOR, "127.0.0.1:9")
    monkeypatch.setenv(join.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(join.ENV_PROCESS_ID, "0")
    join.join_launched_job()
    assert [name for name, _ in fake_job.config] == ["jax_cpu_collectives_implementation"]
    assert fake_job.calls[0]["heartbeat_timeout_seconds"] == join.DEFAULT_HEARTBEAT_TIMEOUT
    assert fake_job.pinned == [{"hostname": "127.0.0.1"}]


def test_jax_release_reads_jaxs_own_version():
    assert join._jax_release()[:2] == tuple(int(x) for x in jax.__version__.split(".")[:2])


def test_the_cache_folder_is_jaxs_setting_else_its_variable(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/from/the/variable")
    assert join._cache_folder() == (jax.config.jax_compilation_cache_dir or "/from/the/variable")


@pytest.mark.parametrize(
    "release, processes, keep, off",
    [
        ((0, 12, 1), 2, "", True),
        ((0, 13, 0), 3, "", True),
        ((0, 11, 2), 2, "", False),  # (the same job runs from a warm cache)
        ((0, 12, 1), 1, "", False),  # one process: nothing to meet
        ((0, 12, 1), 2, "keep", False),
    ],
)
def test_a_job_of_several_processes_turns_the_compilation_cache_off_from_jax_0_12(
    monkeypatch, fake_job, caplog, release, processes, keep, off
):
    monkeypatch.setattr(join, "_jax_release", lambda: release)
    monkeypatch.setenv(join.ENV_COMPILATION_CACHE, keep)
    monkeypatch.setattr(join, "_cache_folder", lambda: "/cache/of/the/job")
    with caplog.at_level(logging.INFO, logger="jaxkv"):
        assert join.no_mixed_compilation_cache(processes) is off
    assert (("jax_enable_compilation_cache", False) in fake_job.config) is off
    said = [r for r in caplog.records if "compilation cache" in r.getMessage()]
    assert len(said) == off
    if off:
        assert said[0].levelno == logging.WARNING
        assert "/cache/of/the/job" in said[0].getMessage()
        assert f"{join.ENV_COMPILATION_CACHE}=keep" in said[0].getMessage()


def test_without_a_cache_folder_the_cache_is_turned_off_quietly(monkeypatch, fake_job, caplog):
    monkeypatch.setattr(join, "_jax_release", lambda: (0, 12, 1))
    monkeypatch.setattr(join, "_cache_folder", lambda: None)
    with caplog.at_level(logging.INFO, logger="jaxkv"):
        assert join.no_mixed_compilation_cache(2) is True
    said = [r for r in caplog.records if "compilation cache" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]


def test_a_launched_process_of_jax_0_12_turns_the_compilation_cache_off(monkeypatch, fake_job):
    monkeypatch.setattr(join, "_jax_release", lambda: (0, 12, 1))
    monkeypatch.setenv(join.ENV_COORDINATOR, "127.0.0.1:9")
    monkeypatch.setenv(join.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(join.ENV_PROCESS_ID, "1")
    join.join_launched_job()
    assert ("jax_enable_compilation_cache", False) in fake_job.config


_SLURM = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[0-1]", "SLURM_PROCID": "0"}


@pytest.mark.parametrize(
    "variables, found",
    [
        ({**_SLURM, "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}, "slurm"),
        ({**_SLURM, "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, None),  # one task: no job
        ({**_SLURM, "SLURM_LOCALID": "0"}, None),  # no task count: one task
        ({**_SLURM, "SLURM_NTASKS": "2"}, None),  # not a step of srun: no SLURM_LOCALID
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "ompi"),
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, None),  # not under mpirun
        ({}, None),
    ],
)
def test_slurm_and_open_mpi_jobs_of_several_tasks_are_found_by_their_variables(
    monkeypatch, variables, found
):
    monkeypatch.setattr(jax_internals, "cluster_environments", lambda: None)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert join.detected_cluster() == found


def _env(name, present=True, count=2, broken=False):
    def get_process_count():
        if broken:
            raise KeyError("a variable JAX needs")
        return count

    return type(
        name, (), {"is_env_present": lambda: present, "get_process_count": get_process_count}
    )


@pytest.mark.parametrize(
    "environments, found",
    [
        ([_env("SlurmCluster", present=False), _env("OmpiCluster")], "ompi"),
        ([_env("SlurmCluster"), _env("OmpiCluster")], "slurm"),  # the first present decides
        ([_env("SlurmCluster", count=1), _env("OmpiCluster")], None),
        ([_env("SlurmCluster", broken=True), _env("OmpiCluster")], None),
        ([_env("K8sCluster", present=False)], None),
        ([_env("GkeTpuCluster")], "gketpu"),
        ([_env("Cluster")], "cluster"),  # nothing left of the name but the suffix
    ],
)
def test_jaxs_cluster_environments_are_tried_in_order(monkeypatch, environments, found):
    monkeypatch.setattr(jax_internals, "cluster_environments", lambda: environments)
    assert join.detected_cluster() == found


def test_join_cluster_joins_what_jax_detects_and_pins_gloo_toward_its_coordinator(
    monkeypatch, fake_job
):
    monkeypatch.setattr(jax_internals, "cluster_environments", lambda: [_env("SlurmCluster")])
    state = types.SimpleNamespace(coordinator_address="127.0.0.1:9", process_id=1)
    monkeypatch.setattr(jax_internals, "distributed_state", lambda: state)
    monkeypatch.setenv(join.ENV_HEARTBEAT_TIMEOUT, "13")
    monkeypatch.setattr(join, "_jax_release", lambda: (0, 12, 1))
    assert join.join_cluster() is True
    assert fake_job.calls == [{"heartbeat_timeout_seconds": 13}]  # JAX finds the rest
    assert ("jax_cpu_collectives_implementation", "gloo") in fake_job.config
    assert ("jax_enable_compilation_cache", False) in fake_job.config
    assert fake_job.pinned == [{"hostname": "127.0.0.1"}]
    assert fake_job.hooked == [True]


def test_join_cluster_joins_nothing_where_no_job_of_several_is_found(monkeypatch, fake_job):
    monkeypatch.setattr(
        jax_internals, "cluster_environments", lambda: [_env("SlurmCluster", count=1)]
    )
    assert join.join_cluster() is False
    assert fake_job.calls == [] and fake_job.config == []


def test_join_cluster_says_so_when_the_process_has_joined_already(fake_job):
    fake_job.initialized = True
    assert join.join_cluster() is True
    assert fake_job.calls == []


def test_process_devices_are_each_process_first_device_in_process_order(monkeypatch):
    def device(process, i):
        return types.SimpleNamespace(process_index=process, id=i)

    devices = [device(1, 0), device(0, 1), device(1, 2), device(2, 3), device(0, 4)]
    monkeypatch.setattr(jax, "devices", lambda: devices)
    assert join.process_devices() == [devices[1], devices[0], devices[3]]


def test_in_one_process_the_process_devices_are_its_first_device():
    assert join.process_devices() == [jax.devices()[0]]
