"""jaxkv's implementation, a folder per concern (README.md says the layers and the rule)."""
