"""Fused primitives: contract, backend interface, backends, dispatch and the autograd Function (docs/design.md)."""
