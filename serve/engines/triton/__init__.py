"""Triton: the replica deployment that owns one Triton, the host of that Triton
(in-process or a sidecar process), and the replica's own pipeline steps."""
