"""jaxkv/_src/checkpoint/npz.py: array aN of a file is manifest entry N, every byte count and
checksum is checked before the store changes, and a residual must have one block per device
of the loading store."""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv._src.checkpoint import npz

SGD = optax.sgd(0.1, momentum=0.9)


def _distinct(like, start):
    """An array like ``like`` (shape, dtype, placement) holding start, start+1, ..."""
    host = (np.arange(like.size) + start).astype(like.dtype).reshape(like.shape)
    return jax.device_put(host, like.sharding)


@pytest.fixture(scope="module")
def compressed(devices):
    """A store on 2 devices under 2-bit compression: keys 0, 1 and 2 (a scalar), optimizer
    groups (0, 1) and (2,), every residual and optimizer array holding distinct values."""
    s = jaxkv.empty(devices[:2], compression={"type": "2bit", "threshold": 0.5})
    s = jaxkv.init(s, {0: jnp.arange(3.0), 1: jnp.arange(4.0).reshape(2, 2), 2: jnp.float32(7)})
    s = jaxkv.init_optimizer(jaxkv.init_optimizer(s, SGD, [0, 1]), SGD, [2])
    residuals = {k: _distinct(r, 100 + 10 * k) for k, r in s.residuals.items()}
    opt = {
        g: jax.tree_util.tree_map(lambda x, g=g: _distinct(x, 200 + 50 * len(g)), o)
        for g, o in s.opt_states.items()
    }
    return s.replace(residuals=residuals, opt_states=opt)


@pytest.fixture(scope="module")
def plain(devices):
    """A store on 2 devices with values sharded from 4 elements: an empty value, an int32
    value split over the devices, and a float16 scalar; no optimizer."""
    s = jaxkv.empty(devices[:2], bigarray_bound=4)
    values = {
        "a": jnp.zeros((0,), jnp.float32),
        "b": jnp.arange(6, dtype=jnp.int32).reshape(2, 3) - 3,
        "c": jnp.float16(1.5),
    }
    return jaxkv.init(s, values)


def _leaves(state):
    """Every value, residual and optimizer-state array of ``state``, key by key, then group by
    group (whatever layout keeps them)."""
    out = []
    for k in state.keys():
        out.append(np.asarray(state[k]))
        if state.residuals[k] is not None:
            out.append(np.asarray(state.residuals[k]))
    for o in state.opt_states.values():
        out += [np.asarray(x) for x in jax.tree_util.tree_leaves(o)]
    return out


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(g, w)


def _saved(tmp_path, state, values=True, name="s.npz"):
    path = str(tmp_path / name)
    npz.save(path, state, values=values)
    return path


def _rewrite(path, edit, rehash=True):
    """Rewrite the file at ``path`` after ``edit(manifest, arrays)``: the manifest's checksum
    recomputed, and each array's too where ``rehash``."""
    with np.load(path) as z:
        arrays = {name: z[name].copy() for name in z.files}
    manifest = json.loads(bytes(arrays["manifest"]).decode())
    edit(manifest, arrays)
    if rehash:
        for n, e in enumerate(manifest["arrays"]):
            e["sha256"] = hashlib.sha256(arrays[f"a{n}"].tobytes()).hexdigest()
    text = json.dumps(manifest).encode()
    arrays["manifest"] = np.frombuffer(text, np.uint8)
    arrays["manifest_sha256"] = np.frombuffer(hashlib.sha256(text).hexdigest().encode(), np.uint8)
    np.savez(path, **arrays)


def _refused(path, like, match, **kw):
    before = _leaves(like)
    kw.setdefault("values", True)
    with pytest.raises(jaxkv.KVStoreError, match=match) as err:
        npz.load(path, like, **kw)
    assert str(err.value).startswith(f"{path}: ")
    _assert_same(_leaves(like), before)  # the store the load was given is as it was


def test_a_store_loads_back_every_value_residual_and_optimizer_group(tmp_path, compressed, devices):
    path = _saved(tmp_path, compressed)
    loaded = npz.load(path, jaxkv.empty(devices[2:4]), values=True, optimizer=SGD)
    assert list(loaded.keys()) == [0, 1, 2] and list(loaded.opt_states) == [(0, 1), (2,)]
    assert loaded.compression == ("2bit", 0.5)
    _assert_same(_leaves(loaded), _leaves(compressed))
    arrays = [loaded[k] for k in loaded.keys()] + list(loaded.residuals.values())
    for x in arrays + jax.tree_util.tree_leaves(dict(loaded.opt_states)):
        assert x.sharding.device_set == set(devices[2:4])  # on the loading store's devices


def test_array_n_is_manifest_entry_n_values_and_residuals_by_key_then_groups(tmp_path, compressed):
    path = _saved(tmp_path, compressed)
    with np.load(path) as z:
        manifest = json.loads(bytes(z["manifest"]).decode())
        raw = [z[f"a{n}"].tobytes() for n in range(len(manifest["arrays"]))]
        assert set(z.files) == {f"a{n}" for n in range(len(raw))} | {"manifest", "manifest_sha256"}
    want = []
    for k in (0, 1, 2):
        want += [
            ({"key": k}, "value", compressed[k]),
            ({"key": k}, "residual", compressed.residuals[k]),
        ]
    for n, g in enumerate([(0, 1), (2,)]):
        want += [
            ({"group": n}, "opt", x) for x in jax.tree_util.tree_leaves(compressed.opt_states[g])
        ]
    assert len(manifest["arrays"]) == len(want)
    for e, r, (where, part, x) in zip(manifest["arrays"], raw, want):
        host = np.asarray(x)
        assert {k: e[k] for k in where} == where and e["part"] == part
        assert (e["shape"], e["dtype"]) == (list(host.shape), str(host.dtype))
        assert r == host.tobytes() and e["sha256"] == hashlib.sha256(r).hexdigest()


def test_empty_scalar_int_and_sharded_values_load_back_exactly(tmp_path, plain, devices):
    assert not plain["b"].is_fully_replicated  # saved from its two halves
    path = _saved(tmp_path, plain)
    loaded = npz.load(path, jaxkv.empty(devices[:2], bigarray_bound=4), values=True)
    assert list(loaded.keys()) == ["a", "b", "c"] and not loaded.opt_states
    _assert_same(_leaves(loaded), _leaves(plain))
    assert not loaded["b"].is_fully_replicated  # 6 elements, over the bound: split again


def test_a_file_rewritten_unchanged_still_loads(tmp_path, plain, devices):
    path = _saved(tmp_path, plain)
    _rewrite(path, lambda m, a: None)  # rewriting alone changes nothing a load sees
    loaded = npz.load(path, jaxkv.empty(devices[:2]), values=True)
    _assert_same(_leaves(loaded), _leaves(plain))


@pytest.mark.parametrize("delta", [-1, 1, -4, 4])
def test_an_array_a_byte_or_an_item_off_its_shape_is_refused(tmp_path, plain, delta):
    path = _saved(tmp_path, plain)

    def edit(m, arrays):
        assert m["arrays"][1]["key"] == "b"
        raw = arrays["a1"]
        arrays["a1"] = raw[:delta] if delta < 0 else np.concatenate([raw, raw[:delta]])

    _rewrite(path, edit)
    _refused(
        path,
        plain,
        rf"key 'b' value: expected 24 bytes for shape \[2, 3\] of int32, given {24 + delta}",
    )


def test_a_file_with_an_array_beyond_its_manifest_is_refused(tmp_path, plain):
    path = _saved(tmp_path, plain)

    def edit(m, arrays):
        arrays[f"a{len(m['arrays'])}"] = arrays["a0"]  # one past the last entry

    _rewrite(path, edit)
    _refused(path, plain, r"expected no arrays but the manifest's, given \['a3'\]")


def test_a_manifest_that_does_not_match_its_checksum_is_refused(tmp_path, plain):
    path = _saved(tmp_path, plain)
    _rewrite(path, lambda m, a: None)
    with np.load(path) as z:
        arrays = {n: z[n].copy() for n in z.files}
    arrays["manifest_sha256"][-1] ^= 1  # one bit of the recorded checksum
    np.savez(path, **arrays)
    _refused(path, plain, "manifest checksum mismatch")


def test_an_array_whose_bytes_differ_from_its_checksum_is_refused_by_its_label(
    tmp_path, compressed
):
    path = _saved(tmp_path, compressed)

    def flip(n):
        def edit(m, arrays):
            arrays[f"a{n}"][0] ^= 1

        return edit

    _rewrite(path, flip(3), rehash=False)  # key 1's residual
    _refused(path, compressed, r"key 1 residual: checksum mismatch", optimizer=SGD)
    path = _saved(tmp_path, compressed)
    _rewrite(path, flip(8), rehash=False)  # the last array: group 1's optimizer state
    _refused(path, compressed, r"optimizer group 1 opt\S*: checksum mismatch", optimizer=SGD)


def _not_a_store(path):
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 not a zip archive")


def _npy(path):
    with open(path, "wb") as f:
        np.save(f, np.arange(3))


def _no_checksum(path):
    np.savez(path, manifest=np.frombuffer(b"{}", np.uint8))


def _empty(path):
    open(path, "wb").close()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (_not_a_store, "expected a jaxkv store file, given one that cannot be read"),
        (_npy, "expected an .npz archive, given one ndarray"),
        (_no_checksum, "expected a jaxkv-store v3 file with a checksummed manifest"),
        (_empty, "expected a jaxkv store file, given one that cannot be read"),
        (None, r"x.npz: cannot be read: no such file or directory \(ENOENT\)"),
    ],
)
def test_a_file_that_is_not_a_store_file_is_refused(tmp_path, plain, make, match):
    path = str(tmp_path / "x.npz")
    if make is not None:
        make(path)
    _refused(path, plain, match)


def test_a_whole_store_file_and_an_optimizer_state_file_are_not_taken_for_each_other(
    tmp_path, compressed
):
    whole = _saved(tmp_path, compressed, values=True, name="whole.npz")
    opt = _saved(tmp_path, compressed, values=False, name="opt.npz")
    _refused(whole, compressed, r"expected an optimizer-state file", values=False, optimizer=SGD)
    _refused(opt, compressed, r"expected a whole-store file \(save\)", values=True, optimizer=SGD)


def test_an_optimizer_state_file_replaces_only_the_optimizer_states(tmp_path, compressed):
    path = _saved(tmp_path, compressed, values=False)
    values = {k: _distinct(compressed[k], -9) for k in compressed.keys()}
    zeros = {g: jax.tree_util.tree_map(jnp.zeros_like, o) for g, o in compressed.opt_states.items()}
    other = compressed.replace(values=values, opt_states=zeros)
    loaded = npz.load(path, other, values=False, optimizer=SGD)
    opt = [np.asarray(x) for x in jax.tree_util.tree_leaves(dict(loaded.opt_states))]
    _assert_same(
        opt, [np.asarray(x) for x in jax.tree_util.tree_leaves(dict(compressed.opt_states))]
    )
    _assert_same(
        [np.asarray(loaded[k]) for k in loaded.keys()], [np.asarray(v) for v in values.values()]
    )


def test_an_optimizer_state_file_for_other_keys_is_refused(tmp_path, compressed, plain):
    path = _saved(tmp_path, compressed, values=False)
    _refused(
        path,
        plain,
        r"expected optimizer states for keys \['a', 'b', 'c'\], given keys \[0, 1, 2\]",
        values=False,
        optimizer=SGD,
    )


def test_optimizer_state_without_an_optimizer_or_of_another_optimizer_is_refused(
    tmp_path, compressed
):
    path = _saved(tmp_path, compressed)
    _refused(path, compressed, r"keys \[0, 1\] have optimizer state: expected a store with an")
    _refused(
        path,
        compressed,
        r"optimizer group \[0, 1\]: optimizer state expected",
        optimizer=optax.adam(0.1),
    )
    # adagrad keeps as many arrays of the same shapes as momentum: only their paths differ
    _refused(
        path,
        compressed,
        r"optimizer group \[0, 1\]: optimizer state expected \[\('\[0\].sum_of_squares\[0\]'",
        optimizer=optax.adagrad(0.1),
    )


def test_a_residual_saved_on_2_devices_is_refused_by_a_store_on_4(tmp_path, compressed, devices):
    path = _saved(tmp_path, compressed)
    _refused(
        path,
        jaxkv.empty(devices[:4]),
        r"key 0: residual expected shape \(12,\) and dtype float32 \(one block per device of "
        r"this store\), given \(6,\) and float32",
        optimizer=SGD,
    )


def test_a_residual_of_the_right_shape_but_another_dtype_is_refused(tmp_path, compressed):
    path = _saved(tmp_path, compressed)

    def edit(m, arrays):
        assert (m["arrays"][1]["part"], m["arrays"][1]["dtype"]) == ("residual", "float32")
        m["arrays"][1]["dtype"] = "int32"  # the same 24 bytes, read as int32

    _rewrite(path, edit)
    _refused(
        path, compressed, r"key 0: residual expected shape \(6,\) and dtype float32", optimizer=SGD
    )


def test_an_entry_is_named_by_its_key_or_its_optimizer_group():
    assert npz._label({"key": "w", "part": "value", "path": ""}) == "key 'w' value"
    assert npz._label({"key": 3, "part": "residual", "path": ""}) == "key 3 residual"
    group = {"group": 1, "part": "opt", "path": "[0].trace['w']"}
    assert npz._label(group) == "optimizer group 1 opt[0].trace['w']"


def test_a_save_replaces_the_file_whole_leaving_no_temporary_file(tmp_path, plain, compressed):
    path = str(tmp_path / "new" / "dir" / "s.npz")  # parents are made
    npz.save(path, compressed, values=True)
    npz.save(path, plain, values=True)  # over the old file
    assert os.listdir(tmp_path / "new" / "dir") == ["s.npz"]
    with np.load(path) as z:
        assert json.loads(bytes(z["manifest"]).decode())["keys"] == ["a", "b", "c"]


def test_a_save_that_cannot_replace_its_target_leaves_no_temporary_file(tmp_path, plain):
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)  # a file cannot replace a directory
    with pytest.raises(OSError):
        npz.save(str(target), plain, values=True)
    assert os.listdir(tmp_path) == ["taken"] and os.listdir(target) == ["inside"]


def test_save_state_and_load_state_refuse_what_is_no_kvstate(tmp_path, plain):
    path = str(tmp_path / "s.npz")
    with pytest.raises(jaxkv.KVStoreError, match="state: expected a jaxkv.KVState, given dict"):
        npz.save_state(path, {"a": 1})
    assert not os.path.exists(path)
    npz.save_state(path, plain)
    with pytest.raises(jaxkv.KVStoreError, match="like: expected a jaxkv.KVState, given NoneType"):
        npz.load_state(path, None)


def test_a_value_of_a_dtype_jax_cannot_hold_is_refused(tmp_path, plain):
    path = _saved(tmp_path, plain)

    def edit(m, arrays):
        m["arrays"][1]["dtype"] = "S4"  # 6 items of 4 bytes: the same 24 bytes

    _rewrite(path, edit)
    _refused(path, plain, "dtype")
