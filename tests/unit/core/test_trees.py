"""jaxkv/_src/core/trees.py: a tree's leaves keyed by their paths, what counts as a tree, and
the refusals of trees and plain keys mixed."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv._src.core import trees


def test_paths_name_the_leaves():
    tree = {
        "params": {"dense": {"kernel": jnp.ones(2), "bias": jnp.zeros(1)}},
        "step": [jnp.ones(1)],
    }
    t = trees.Tree(tree)
    assert sorted(t.keys) == ["params/dense/bias", "params/dense/kernel", "step/0"]
    assert t.paths() == tuple(sorted(t.keys))
    back = trees.fill(t, [np.float32(n) for n in range(len(t.keys))])
    assert set(back) == {"params", "step"} and isinstance(back["step"], list)


def test_what_is_a_tree():
    Pair = collections.namedtuple("Pair", "a b")
    assert trees.is_tree({"a": {"b": jnp.ones(1)}})
    assert trees.is_tree(Pair(jnp.ones(1), jnp.ones(1)))  # a namedtuple is a node
    assert not trees.is_tree({"a": jnp.ones(1), "b": 2.0})  # a flat mapping of values
    assert not trees.is_tree({"a": [jnp.ones(1), jnp.ones(1)]})  # per-device values
    assert not trees.is_tree(["a", "b"]) and not trees.is_tree("a") and not trees.is_tree(3)
    assert trees.split({"a": jnp.ones(1)}) is None
    assert trees.structure({"a": jnp.ones(1)}) is not None  # pull's argument: any mapping


def test_two_leaves_named_alike_are_refused():
    with pytest.raises(jaxkv.KVStoreError, match="tree key 'a/b': expected each leaf's path"):
        trees.Tree({"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}})


def test_trees_and_plain_keys_do_not_mix():
    tree = {"w": {"a": jnp.ones(2), "b": jnp.zeros(2)}}
    state = jaxkv.init(jaxkv.empty(), tree)
    with pytest.raises(jaxkv.KeyTypeError, match="expected a tree"):
        trees.check_init(state, None, ["plain"])
    plain = jaxkv.init(jaxkv.empty(), {"x": jnp.ones(1)})
    with pytest.raises(jaxkv.KeyTypeError, match="expected a store of trees"):
        trees.check_init(plain, trees.Tree(tree), list(trees.Tree(tree).keys))
    trees.check_push(state, trees.Tree(tree))  # the same paths: taken
    with pytest.raises(jaxkv.KVStoreError, match="no leaf at path 'w/b'"):
        trees.check_push(state, trees.Tree({"w": {"a": jnp.ones(2)}}))
    with pytest.raises(jaxkv.KVStoreError, match="path 'w/c', which the stored tree does not"):
        trees.check_push(state, trees.Tree({"w": {"a": jnp.ones(2), "b": 1, "c": 2}}))
