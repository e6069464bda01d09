"""Rows of a table: row-sparse pushes and pulls, and the kernels that route and apply them."""
