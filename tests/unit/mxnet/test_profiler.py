"""jaxkv/_src/mxnet/profiler.py: MXNet's ``mx.profiler`` calls over ``jax.profiler``, the files
they write, the statistics of ``dumps``, the profiling objects' events and the refusals."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import pytest

import jaxkv
import jaxkv.mx as mx
from jaxkv._src.mxnet import profiler


@pytest.fixture(autouse=True)
def _fresh_profiler(monkeypatch, tmp_path):
    """Each test starts from a profiler never configured, in its own directory, and leaves it
    stopped (and the module's own alone)."""
    monkeypatch.setattr(profiler, "_PROFILER", profiler._Profiler())
    monkeypatch.chdir(tmp_path)
    yield
    if profiler._PROFILER.tracing:
        jax.profiler.stop_trace()


def events(filename="profile.json"):
    with open(filename) as f:
        return json.load(f)["traceEvents"]


def named(filename, name):
    return [e for e in events(filename) if e.get("name") == name]


def work():
    jax.block_until_ready(jnp.arange(8.0) * 2)


def test_it_is_jaxkv_mx_profiler():
    assert mx.profiler.set_state is profiler.set_state
    assert "profiler" in mx.__all__


def test_a_run_writes_a_chrome_trace_at_filename_and_jaxs_trace_beside_it():
    mx.profiler.set_config(profile_all=True, filename="out/run.json", continuous_dump=True)
    mx.profiler.set_state("run")
    task = mx.profiler.Domain("train").new_task("step")
    task.start()
    work()
    task.stop()
    mx.profiler.set_state("stop")
    (step,) = named("out/run.json", "step")
    assert step["ph"] == "X" and step["args"] == {"domain": "train"} and step["dur"] > 0
    assert glob.glob("out/run/plugins/profile/*/*.xplane.pb")  # TensorBoard's log directory
    assert glob.glob("out/run/plugins/profile/*/perfetto_trace.json.gz")
    assert not os.path.exists("gpu_memory_profile.prof")  # no memory profile unless asked


def test_the_default_filename_is_mxnets_and_a_name_without_extension_gets_a_trace_folder():
    assert profiler._PROFILER.filename() == "profile.json"
    assert profiler._PROFILER.trace_dir() == "profile"
    mx.profiler.set_config(filename="trace")
    assert profiler._PROFILER.trace_dir() == "trace_trace"


def test_each_process_of_a_job_writes_its_own_files(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    mx.profiler.set_config(filename="logs/p.json")
    assert profiler._PROFILER.filename() == os.path.join("logs", "p.1.json")
    assert profiler._PROFILER.trace_dir() == os.path.join("logs", "p.1")


def test_every_profiling_object_records_its_events():
    mx.profiler.set_state("run")
    domain = mx.profiler.Domain("d")
    frame, event = domain.new_frame("frame"), mx.profiler.Event("event")
    frame.start()
    event.start()
    event.stop()
    frame.stop()
    counter = domain.new_counter("count", 5)
    counter += 2
    counter -= 1
    counter.increment(3)
    counter.decrement()
    domain.new_marker("mark").mark("thread")
    with mx.profiler.Scope("outer"):
        with mx.profiler.Scope("inner", append_mode=True) as scope:
            assert scope.name == "outer:inner:"
        with mx.profiler.Scope("alone") as alone:
            assert alone.name == "alone:"
    mx.profiler.set_state("stop")
    assert named("profile.json", "frame")[0]["args"] == {"domain": "d"}
    assert len(named("profile.json", "event")) == 1
    assert [e["args"]["value"] for e in named("profile.json", "count")] == ["5", "7", "6", "9", "8"]
    assert counter.value == 8 and str(counter) == "count" and str(domain) == "d"
    assert named("profile.json", "mark")[0]["args"] == {"domain": "d", "scope": "thread"}
    assert named("profile.json", "outer/inner") and named("profile.json", "alone")


def test_a_scope_names_the_ops_traced_inside_it_and_restores_the_one_around_it():
    names = []

    def f(x):
        with mx.profiler.Scope("layer1:"):
            with mx.profiler.Scope("dense", append_mode=True) as inner:
                y = x + 1
            names.append((inner.name, profiler.Scope._current.value.name))
            return y

    text = jax.jit(f).lower(jnp.ones(2)).as_text(debug_info=True)
    assert "layer1/dense/add" in text
    assert names == [("layer1:dense:", "layer1:")]
    assert getattr(profiler.Scope._current, "value", None) is None


def test_a_pause_leaves_out_what_runs_until_resume_and_times_follow_on():
    mx.profiler.set_state("run")
    before = mx.profiler.Event("before")
    before.start()
    before.stop()
    mx.profiler.pause()
    mx.profiler.pause()  # paused already: nothing
    hidden = mx.profiler.Event("hidden")
    hidden.start()
    hidden.stop()
    mx.profiler.resume()
    after = mx.profiler.Event("after")
    after.start()
    after.stop()
    mx.profiler.set_state("stop")
    assert not named("profile.json", "hidden")
    (first,), (second,) = named("profile.json", "before"), named("profile.json", "after")
    assert second["ts"] > first["ts"]
    mx.profiler.resume()  # stopped: nothing
    assert not profiler._PROFILER.tracing


def test_dump_writes_now_and_finished_stops_or_keeps_running():
    mx.profiler.set_state("run")
    mx.profiler.Marker(mx.profiler.Domain("d"), "one").mark()
    mx.profiler.dump(finished=False)
    assert named("profile.json", "one") and profiler._PROFILER.tracing
    mx.profiler.Marker(mx.profiler.Domain("d"), "two").mark()
    mx.profiler.dump()  # finished: stopped
    assert named("profile.json", "one") and named("profile.json", "two")
    assert not profiler._PROFILER.tracing and profiler._PROFILER.state == "stop"
    mx.profiler.set_state("run")  # a new profile
    mx.profiler.Marker(mx.profiler.Domain("d"), "three").mark()
    mx.profiler.set_state("stop")
    assert not named("profile.json", "one") and named("profile.json", "three")


def test_stop_then_run_again_keeps_adding_to_the_profile():
    for name in ("first", "second"):
        mx.profiler.set_state("run")
        mx.profiler.set_state("run")  # running already: nothing
        mx.profiler.Marker(mx.profiler.Domain("d"), name).mark()
        mx.profiler.set_state("stop")
        mx.profiler.set_state("stop")  # stopped already: nothing
    assert named("profile.json", "first") and named("profile.json", "second")


def test_dumps_aggregates_the_events_of_the_sessions_that_ended():
    assert "No events recorded yet" in mx.profiler.dumps()
    mx.profiler.set_state("run")
    task = mx.profiler.Domain("d").new_task("a_task")
    for _ in range(3):
        task.start()
        work()
        task.stop()
    assert "running trace session is not included" in mx.profiler.dumps()
    mx.profiler.set_state("stop")
    table = mx.profiler.dumps()
    assert table.startswith("Profile Statistics:")
    assert "Total Count" in table and "Avg Time (ms)" in table
    (line,) = [x for x in table.splitlines() if x.startswith("a_task ")]
    count, total, low, high, avg = line.split()[1:]
    assert int(count) == 3 and float(low) <= float(avg) <= float(high)
    assert float(total) == pytest.approx(3 * float(avg), rel=1e-3, abs=1e-3)
    assert not [x for x in table.splitlines() if x.startswith("$")]  # no Python functions
    stats = json.loads(mx.profiler.dumps(format="json", sort_by="count", ascending=True))
    assert stats["Unit"] == {"Time": "ms"}
    (group,) = [g for g in stats["Time"].values() if "a_task" in g]
    assert group["a_task"]["Total Count"] == 3
    counts = [row["Total Count"] for row in group.values()]
    assert counts == sorted(counts)
    mx.profiler.dumps(reset=True)
    assert "a_task" not in mx.profiler.dumps()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"profile_everything": True}, "unknown argument 'profile_everything'"),
        ({"profile_all": "yes"}, "profile_all: expected a boolean"),
        ({"dump_period": -1}, "dump_period: expected seconds >= 0"),
        ({"dump_period": "soon"}, "dump_period"),
        ({"filename": 3}, "filename: expected a path"),
        ({"filename": ""}, "filename: expected a path"),
        ({"profile_process": "server"}, "no parameter servers"),
        ({"profile_process": "client"}, "expected 'worker' or 'server'"),
    ],
)
def test_set_config_refuses_what_mxnet_refuses_or_jaxkv_cannot_do(kwargs, match):
    with pytest.raises(mx.profiler.ProfilerArgumentError, match=match) as e:
        mx.profiler.set_config(**kwargs)
    assert isinstance(e.value, mx.MXNetError) and isinstance(e.value, ValueError)
    assert profiler._PROFILER.config == profiler._DEFAULTS


def test_set_config_takes_mxnets_flags_as_it_parses_them():
    mx.profiler.set_config(profile_all="True", profile_api=0, aggregate_stats="false")
    mx.profiler.set_config(profile_process="worker", dump_period=2)


def test_refusals_of_states_formats_and_servers():
    for call, match in [
        (lambda: mx.profiler.set_state("go"), "expected 'run' or 'stop'"),
        (lambda: mx.profiler.set_state("run", profile_process="server"), "no parameter servers"),
        (lambda: mx.profiler.dump(profile_process="server"), "no parameter servers"),
        (lambda: mx.profiler.pause("server"), "no parameter servers"),
        (lambda: mx.profiler.resume("server"), "no parameter servers"),
        (lambda: mx.profiler.dumps(format="csv"), "expected 'table' or 'json'"),
        (lambda: mx.profiler.dumps(sort_by="name"), "sort_by"),
        (lambda: mx.profiler.dumps(reset="yes"), "reset"),
        (lambda: mx.profiler.Marker(mx.profiler.Domain("d"), "m").mark("world"), "scope"),
    ]:
        with pytest.raises(mx.profiler.ProfilerArgumentError, match=match):
            call()
    assert not profiler._PROFILER.tracing


def test_out_of_order_calls_are_refused_and_change_nothing():
    mx.profiler.set_state("run")
    with pytest.raises(mx.profiler.ProfilerStateError, match="set_state\\('stop'\\) first"):
        mx.profiler.set_config(filename="other.json")
    mx.profiler.set_state("stop")
    assert profiler._PROFILER.config["filename"] == "profile.json"
    task = mx.profiler.Domain("d").new_task("t")
    with pytest.raises(mx.profiler.ProfilerStateError, match="without start"):
        task.stop()
    task.start()
    with pytest.raises(mx.profiler.ProfilerStateError, match="already started"):
        task.start()
    task.stop()


def test_a_jax_trace_running_elsewhere_is_named_and_the_state_stays_stopped(tmp_path):
    with jax.profiler.trace(str(tmp_path / "mine")):
        with pytest.raises(jaxkv.KVStoreError, match="stop it first") as e:
            mx.profiler.set_state("run")
        assert isinstance(e.value, RuntimeError)
    assert profiler._PROFILER.state == "stop" and not profiler._PROFILER.tracing


def test_a_memory_profile_is_written_where_its_prefix_says():
    mx.profiler.set_config(gpu_memory_profile_filename_prefix="mem/device", profile_memory=True)
    mx.profiler.set_state("run")
    x = jnp.ones(1000)
    mx.profiler.set_state("stop")
    assert os.path.getsize("mem/device.prof") > 0
    del x


def test_mxnets_deprecated_calls_warn_and_forward():
    with pytest.warns(DeprecationWarning, match="set_config"):
        mx.profiler.profiler_set_config(mode="all", filename="old.json")
    assert profiler._PROFILER.config["profile_all"] is True
    with pytest.warns(DeprecationWarning, match="set_state"):
        mx.profiler.profiler_set_state("run")
    with pytest.warns(DeprecationWarning, match="dump"):
        mx.profiler.dump_profile()
    assert os.path.exists("old.json") and not profiler._PROFILER.tracing
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(mx.profiler.ProfilerArgumentError, match="mode"),
    ):
        mx.profiler.profiler_set_config(mode="everything")
