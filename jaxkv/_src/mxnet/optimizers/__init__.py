"""MXNet's optimizers and learning-rate schedules, bit for bit: the base class and registry, each
family's kernels, float32 arithmetic as MXNet's C++ does it, and the schedules."""
