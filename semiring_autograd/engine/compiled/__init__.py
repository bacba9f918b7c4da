"""The compiled backward: a recorded computation replayed as a straight-line program.

``backward.py`` holds the programs per graph signature (``sa.grad(..., compile=True)``);
``step.py`` is ``sa.compiled_step`` (the patched forward and the backward as one program);
``program.py`` is the recorder and the program it generates; ``signature.py`` says what a
program depends on. This package imports the eager engine (``step.py`` runs ``sa.patch``
and ``sa.grad``); the eager engine reaches it through one seam, :func:`run_backward`,
which ``sa.grad`` calls with ``compile=True``.
"""

from .backward import run_backward

__all__ = ["run_backward"]
