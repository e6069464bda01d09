"""Unit tests of jaxkv/_src/mxnet."""
