"""Unit tests of jaxkv/_src/rows."""
