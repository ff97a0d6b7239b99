"""Compiling for GPUs this machine does not have: targets, and what their programs tell."""
