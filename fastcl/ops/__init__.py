"""Fused primitives: contract, backends, dispatch and autograd Functions (see contract.py)."""
