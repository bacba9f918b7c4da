"""Code generator: derivatives/*.yaml → generated/ (one autograd.Function per op per semiring)."""
