"""Reading a semiring backward: top paths element by element, and token attribution with
its HTML and plot reports."""
