"""jaxkv/_src/mxnet/random.py: the generators' words (seed, kind, index, counter) per device,
the checks of shapes, dtypes and parameters, and the kernels' shapes and ranges."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv._src.mxnet import ndarray, random


@pytest.fixture(autouse=True)
def _fresh_generators(monkeypatch):
    """Each test starts from a generator set never seeded (and leaves the module's alone)."""
    monkeypatch.setattr(random, "_GENERATORS", random._Generators())


def _cpu(i):
    return jaxkv.cpu(i).device


def test_a_devices_words_are_the_seed_its_kind_its_index_and_a_counter_that_advances():
    gens = random._GENERATORS
    assert gens.next_words(_cpu(0)).tolist() == [0, 1, 0, 0]
    assert gens.next_words(_cpu(0)).tolist() == [0, 1, 0, 1]
    assert gens.next_words(_cpu(3)).tolist() == [0, 1, 3, 0]  # its own counter
    assert gens.next_words(_cpu(0)).tolist() == [0, 1, 0, 2]


def test_seeding_all_sets_the_seed_and_restarts_every_counter():
    gens = random._GENERATORS
    gens.next_words(_cpu(0))
    gens.next_words(_cpu(2))
    random.seed(42)
    assert gens.next_words(_cpu(0)).tolist() == [42, 1, 0, 0]
    assert gens.next_words(_cpu(2)).tolist() == [42, 1, 2, 0]


def test_seeding_one_device_drops_its_index_and_leaves_the_others_as_they_were():
    gens = random._GENERATORS
    random.seed(5)
    gens.next_words(_cpu(0))
    gens.next_words(_cpu(1))
    random.seed(9, jaxkv.cpu(1))
    assert gens.next_words(_cpu(1)).tolist() == [9, 1, 0, 0]  # index 0: cpu(0)'s stream of 9
    assert gens.next_words(_cpu(0)).tolist() == [5, 1, 0, 1]  # untouched
    random.seed(7)  # 'all' again: cpu(1) is no longer seeded alone
    assert gens.next_words(_cpu(1)).tolist() == [7, 1, 1, 0]


@pytest.mark.parametrize(
    ("given", "word"), [(7, 7), (2**32 + 7, 7), (-1, 2**32 - 1), (np.int64(3), 3), (True, 1)]
)
def test_a_seed_is_taken_modulo_2_to_the_32(given, word):
    random.seed(given)
    assert random._GENERATORS.next_words(_cpu(0))[0] == word


def test_the_same_words_draw_the_same_numbers_and_each_word_changes_them():
    def draw(words):
        w = jax.device_put(np.array(words, np.uint32), _cpu(0))
        zero, one = (jax.device_put(np.float32(x), _cpu(0)) for x in (0, 1))
        return np.asarray(random._uniform(w, zero, one, shape=(16,), dtype=np.float32))

    base = draw([1, 1, 0, 0])
    np.testing.assert_array_equal(draw([1, 1, 0, 0]), base)
    for changed in ([2, 1, 0, 0], [1, 2, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]):
        assert not np.array_equal(draw(changed), base), changed


@pytest.mark.parametrize(
    ("shape", "expected"), [(3, (3,)), ((2, 3), (2, 3)), ([4], (4,)), (np.int64(2), (2,))]
)
def test_shapes_mxnet_accepts(shape, expected):
    assert random._shape("f", shape) == expected


@pytest.mark.parametrize("shape", [0, -1, (), (2, 0), 2.5, "3", True, (2, True), (2.0, 2)])
def test_shapes_mxnet_refuses_are_refused_naming_shape(shape):
    with pytest.raises(random.RandomArgumentError, match=r"f: expected shape .* given shape="):
        random._shape("f", shape)


def test_the_default_dtype_is_float32_or_outs_and_an_out_of_another_dtype_is_refused():
    assert random._dtype("f", None, random._FLOATS, None) == np.float32
    half = ndarray.zeros((2,), dtype="float16")
    assert random._dtype("f", None, random._FLOATS, half) == np.float16
    assert random._dtype("f", None, random._INTS, None) == np.int32
    with pytest.raises(random.RandomArgumentError, match="expected out of dtype float32"):
        random._dtype("f", "float32", random._FLOATS, half)


def test_float64_asked_with_an_out_held_as_float32_agrees_with_it():
    out = ndarray.zeros((2,), dtype="float64")  # held and reported float32 (x64 off)
    assert random._dtype("f", "float64", random._FLOATS, out) == np.float64


@pytest.mark.parametrize("dtype", ["int32", "bfloat16", "bogus", bool])
def test_dtypes_outside_mxnets_three_floats_are_refused(dtype):
    with pytest.raises(random.RandomArgumentError, match="expected dtype one of"):
        random._dtype("f", dtype, random._FLOATS, None)


def test_ndarray_parameters_draw_shape_samples_per_element_within_each_ones_bounds():
    low = ndarray.array([0, 10, 100])
    high = ndarray.array([1, 11, 101])
    a = random.uniform(low, high, shape=(50, 2))
    assert a.shape == (3, 50, 2)
    values = a.asnumpy()
    for i, lo in enumerate([0, 10, 100]):
        assert ((values[i] >= lo) & (values[i] < lo + 1)).all()


def test_ndarray_parameters_of_different_shapes_are_refused():
    with pytest.raises(random.RandomArgumentError, match=r"one shape, given shapes \(2,\) and"):
        random.normal(ndarray.array([0, 1]), ndarray.array([1, 1, 1]))


def test_an_out_under_ndarray_parameters_gives_the_samples_shape():
    out = ndarray.zeros((2, 4))
    assert random.normal(ndarray.array([0, 5]), ndarray.array([1, 1]), out=out) is out
    assert abs(out.asnumpy()[1].mean() - 5) < 4  # row 1 drawn around 5


@pytest.mark.parametrize(
    ("low", "high", "match"),
    [
        (2**31, 2**31 + 5, r"expected bounds in \[-2147483648, 2147483647\]"),
        (-(2**31) - 1, 0, "expected bounds in"),
        (1.0, 5, "expected low an int"),
        (1, np.float32(5), "expected high an int"),
        (5, 5, "expected low < high"),
    ],
)
def test_randint_bounds_are_checked_for_the_held_int32(low, high, match):
    with pytest.raises(random.RandomArgumentError, match=match):
        random.randint(low, high, shape=2, dtype="int64")


def test_randint_reaches_both_ends_of_the_int32_range():
    a = random.randint(-(2**31), 2**31 - 1, shape=(1000,)).asnumpy()
    assert a.dtype == np.int32 and a.min() < -(2**30) and a.max() > 2**30


def test_unknown_keyword_arguments_are_refused_and_name_is_ignored():
    assert random.uniform(shape=2, name="x").shape == (2,)
    with pytest.raises(random.RandomArgumentError, match=r"given \['foo'\]"):
        random.uniform(shape=2, foo=1)
