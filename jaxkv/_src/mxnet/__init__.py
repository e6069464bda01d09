"""MXNet's API: the imperative KVStore, NDArray and sparse arrays, MXNet's optimizers, and the calls
a store holds until a value is read."""
