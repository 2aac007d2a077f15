"""Triton kernels, each beside its plain-torch reference in reference.py."""
