"""Unit tests, a file per module of jaxkv/_src, in folders that mirror it: each pins its module's
edges (the feature and property suites are in tests/)."""
