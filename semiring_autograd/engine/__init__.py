"""Recording and running a semiring backward: the op table's dispatch to generated
Functions, ``sa.patch``, ``sa.grad``, what is recorded on each backward node (the op call
itself with ``paths=True``), ``sa.trace``, and ``compiled/`` (``compile=True`` and
``sa.compiled_step``: the backward, or forward and backward, as a captured program)."""
