"""Unit tests of jaxkv/_src/state."""
