"""Processes: joining a job, the one order of collectives across processes, and host collectives."""
