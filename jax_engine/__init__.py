"""The production engine: the reference's ideas built for speed with JAX (see the issues that follow)."""
