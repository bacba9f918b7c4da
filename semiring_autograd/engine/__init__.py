"""Recording and running a semiring backward: the op table's dispatch to generated
Functions, ``sa.patch``, ``sa.grad``, what is recorded on each backward node, replays of
recorded calls, and ``sa.trace``."""
