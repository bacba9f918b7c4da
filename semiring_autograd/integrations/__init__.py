"""Hugging Face models loaded offline, and the ``semiring-autograd`` command line."""
