"""Counting XLA's compiles in a benchmark's own process: a handler of JAX's log records."""

from __future__ import annotations

import logging


class Compiles(logging.Handler):
    """Counts JAX's "Compiling ..." records (with ``jax_log_compiles`` on)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling" in record.getMessage():
            self.count += 1
