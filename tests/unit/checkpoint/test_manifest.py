"""jaxkv/_src/checkpoint/manifest.py: what a manifest must hold, field by field: group indices
below the group count, sizes of zero and up, one array aN per entry N and nothing beside them,
and exactly one value (and one 2-bit residual) per key."""

import copy

import pytest

from jaxkv._src.checkpoint import manifest

KEYS = [0, 1]


def _manifest(values=True, compression=None, groups=((0, 1),)):
    """A manifest as ``save`` writes it: keys 0 and 1 of shape (2,), a residual for each under
    2-bit compression, and one optimizer array per group."""
    arrays = []
    if values:
        for k in KEYS:
            arrays.append({"key": k, "part": "value", "path": "", "shape": [2], "dtype": "float32"})
            if compression and compression[0] == "2bit":
                arrays.append(
                    {"key": k, "part": "residual", "path": "", "shape": [4], "dtype": "float32"}
                )
    for g in range(len(groups)):
        arrays.append({"group": g, "part": "opt", "path": "[0]", "shape": [2], "dtype": "float32"})
    for e in arrays:
        e["sha256"] = "0" * 64
    return {
        "format": manifest.FORMAT,
        "version": manifest.VERSION,
        "values": values,
        "keys": list(KEYS),
        "groups": [list(g) for g in groups],
        "arrays": arrays,
        "compression": compression,
    }


def _files(m):
    """The arrays of the .npz file ``m`` describes: a0, a1, ... and the manifest's own two."""
    return {f"a{n}" for n in range(len(m["arrays"]))} | {"manifest", "manifest_sha256"}


def _refused(m, files, match):
    before = copy.deepcopy(m)
    with pytest.raises(manifest.Malformed, match=match) as err:
        manifest.check_manifest(m, files)
    # Each message names the field, what save writes and what was given; a compression that
    # kvstate refuses carries kvstate's own reason instead.
    text = str(err.value)
    assert text.startswith(("manifest: expected ", "manifest: 'compression' "))
    assert "given " in text or "unexpected parameters" in text
    assert m == before  # the check reads, never repairs


@pytest.mark.parametrize(
    ("values", "compression", "groups"),
    [
        (True, None, ((0, 1),)),
        (True, ["2bit", 0.25], ((0,), (1,))),
        (True, ["fp16"], ()),
        (True, ["bf16"], ((1,),)),
        (False, None, ((0, 1),)),
    ],
)
def test_what_save_writes_is_accepted_with_and_without_files(values, compression, groups):
    m = _manifest(values, compression, groups)
    manifest.check_manifest(m, _files(m))
    manifest.check_manifest(m, None)


def test_the_last_group_index_is_accepted_and_the_group_count_refused():
    m = _manifest(groups=((0,), (1,)))
    assert m["arrays"][-1]["group"] == 1  # the last of two groups
    manifest.check_manifest(m, _files(m))
    for bad in (2, -1, True, 1.0, None):
        m["arrays"][-1]["group"] = bad
        _refused(m, _files(m), r"arrays\[3\] 'group' an index below 2")


def test_an_optimizer_entry_that_also_names_a_key_is_refused():
    m = _manifest()
    m["arrays"][-1]["key"] = 0
    _refused(m, _files(m), r"arrays\[2\] 'group' an index below 1")


@pytest.mark.parametrize("shape", [[0], [], [2, 0, 3]])
def test_a_size_of_zero_is_a_size(shape):
    m = _manifest()
    m["arrays"][0]["shape"] = shape
    manifest.check_manifest(m, _files(m))


@pytest.mark.parametrize("shape", [[-1], [2, -1], [True], [2.0], (2,), "2", None])
def test_a_negative_bool_float_or_non_list_size_is_refused(shape):
    m = _manifest()
    m["arrays"][1]["shape"] = shape
    _refused(m, _files(m), r"arrays\[1\] 'shape' a list of sizes")


def test_every_entry_needs_its_own_array_and_the_file_nothing_more():
    m = _manifest()
    files = _files(m)
    _refused(m, files - {"a2"}, r"an array a2 for arrays\[2\]")  # the last entry's, by index
    _refused(m, files - {"a0"}, r"an array a0 for arrays\[0\]")
    _refused(m, files | {"a3"}, r"no arrays but the manifest's, given \['a3'\]")  # one past
    _refused(m, files | {"extra"}, r"given \['extra'\]")
    manifest.check_manifest(m, None)  # a checkpoint directory lists its files elsewhere


def test_an_array_entry_without_a_sha256_is_refused_only_in_a_file():
    m = _manifest()
    del m["arrays"][1]["sha256"]
    _refused(m, _files(m), r"arrays\[1\] 'sha256' a str")
    manifest.check_manifest(m, None)


@pytest.mark.parametrize(
    ("compression", "residuals", "match"),
    [
        (None, (0,), r"key 0 with 1 value and 0 residual entries, given '1 and 1'"),
        (["fp16"], (1,), r"key 1 with 1 value and 0 residual entries, given '1 and 1'"),
        (["2bit", 0.5], (0,), r"key 1 with 1 value and 1 residual entries, given '1 and 0'"),
        (["2bit", 0.5], (0, 1, 1), r"key 1 with 1 value and 1 residual entries, given '1 and 2'"),
    ],
)
def test_each_key_has_one_residual_under_2bit_compression_and_none_otherwise(
    compression, residuals, match
):
    m = _manifest(compression=compression)
    m["arrays"] = [e for e in m["arrays"] if e["part"] != "residual"]
    for k in residuals:
        m["arrays"].append({"key": k, "part": "residual", "path": "", "shape": [4]})
        m["arrays"][-1].update(dtype="float32", sha256="0" * 64)
    _refused(m, _files(m), match)


@pytest.mark.parametrize(
    ("values", "counts", "match"),
    [
        (True, (1, 2), r"key 1 with 1 value and 0 residual entries, given '2 and 0'"),
        (True, (1, 0), r"key 1 with 1 value and 0 residual entries, given '0 and 0'"),
        (False, (0, 1), r"key 1 with 0 value and 0 residual entries, given '1 and 0'"),
    ],
)
def test_a_whole_store_has_one_value_per_key_and_an_optimizer_file_none(values, counts, match):
    m = _manifest(values=values)
    opt = [e for e in m["arrays"] if e["part"] == "opt"]
    m["arrays"] = [
        {"key": k, "part": "value", "path": "", "shape": [2], "dtype": "float32", "sha256": "0"}
        for k, n in zip(KEYS, counts)
        for _ in range(n)
    ] + opt
    _refused(m, _files(m), match)


@pytest.mark.parametrize(
    ("compression", "match"),
    [
        ([], r"'compression' a list, given \[\]"),
        ("2bit", r"'compression' a list"),
        (["2bit"], r"a valid 'compression', given \['2bit'\]"),  # save writes the threshold
        (["none"], r"a valid 'compression', given \['none'\]"),  # save writes None instead
        (["2bit", 0], r"'compression' \['2bit', 0\]: gradient compression '2bit'"),
        (["fp16", 0.5], r"'compression' \['fp16', 0.5\]: gradient compression 'fp16'"),
        (["zip"], r"'compression' \['zip'\]"),
    ],
)
def test_compression_is_none_or_exactly_what_save_writes(compression, match):
    m = _manifest(compression=compression)
    _refused(m, _files(m), match)


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([[]], "'groups' a list of non-empty lists of keys"),
        ([[0], [2]], "'groups' a list of non-empty lists of keys"),
        ([[0, 1], [1]], r"each key in one group at most, given \[\[0, 1\], \[1\]\]"),
        ([[0, 0]], "each key in one group at most"),
        (None, "'groups' a list"),
        ([(0, 1)], "'groups' a list of non-empty lists"),
    ],
)
def test_groups_are_disjoint_non_empty_lists_of_known_keys(groups, match):
    m = _manifest(groups=())
    m["groups"] = groups
    _refused(m, _files(m), match)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ([0, "a"], "'keys' all int or all str"),
        ([True, False], "'keys' all int or all str"),
        ([0, 0], "distinct 'keys'"),
        ((0, 1), "'keys' a list"),
    ],
)
def test_keys_are_distinct_and_all_int_or_all_str(keys, match):
    m = _manifest(values=False, groups=())
    m["keys"] = keys
    _refused(m, _files(m), match)
    m["keys"] = ["a", "b"]
    manifest.check_manifest(m, _files(m))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("format", "jaxkv-checkpoint", "format 'jaxkv-store' version 3"),
        ("version", manifest.VERSION - 1, r"given \('jaxkv-store', 2\)"),
        ("version", manifest.VERSION + 1, r"given \('jaxkv-store', 4\)"),
        ("values", 1, "'values' true or false, given 1"),
        ("arrays", None, "'arrays' a list"),
    ],
)
def test_a_header_field_other_than_save_writes_is_refused(field, value, match):
    m = _manifest()
    files = _files(m)
    m[field] = value
    _refused(m, files, match)


def test_another_format_and_version_are_accepted_when_asked_for():
    m = _manifest()
    m.update(format="jaxkv-checkpoint", version=1)
    manifest.check_manifest(m, None, "jaxkv-checkpoint", 1)
    _refused(m, None, "format 'jaxkv-store' version 3")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("part", "values", r"arrays\[0\] 'part' one of \('value', 'opt', 'residual'\)"),
        ("key", 2, r"arrays\[0\] 'key' one of \[0, 1\], given 2"),
        ("path", None, r"arrays\[0\] 'path' a str"),
        ("dtype", "float33", r"arrays\[0\] 'dtype' a dtype name, given 'float33'"),
        ("dtype", None, r"arrays\[0\] 'dtype' a dtype name, given None"),
    ],
)
def test_an_entry_field_other_than_save_writes_is_refused(field, value, match):
    m = _manifest()
    m["arrays"][0][field] = value
    _refused(m, _files(m), match)


def test_a_manifest_that_is_no_object_is_refused():
    _refused([], None, "a JSON object, given 'list'")


@pytest.mark.parametrize(
    ("name", "ok"),
    [("float32", True), ("bfloat16", True), ("int8", True), ("bool", True)]
    + [(None, False), ("", False), ("float33", False), (4, False)]
    # JSON that NumPy would take for a (structured) dtype is still no name
    + [({"names": ["a"], "formats": ["f4"]}, False)],
)
def test_a_dtype_name_is_a_str_that_names_a_dtype(name, ok):
    assert manifest.is_dtype_name(name) is ok


@pytest.mark.parametrize("name", ["S4", "U1", "V4", ">f4"])
def test_a_dtype_no_jax_array_has_is_no_dtype_name(name):
    assert not manifest.is_dtype_name(name)


def test_an_unhashable_entry_key_is_malformed():
    m = _manifest()
    m["arrays"][0]["key"] = [0]
    _refused(m, _files(m), r"arrays\[0\] 'key' one of \[0, 1\], given \[0\]")
