"""Mesh, explicit collectives, collective matmul, partition rules and jax-version shims."""
