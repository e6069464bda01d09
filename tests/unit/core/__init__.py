"""Unit tests of jaxkv/_src/core."""
