"""What a generated Function computes with: op specifications, the semiring primitives
formulas are written in, shape and primal helpers, forward helpers, the message type that
carries semiring values through PyTorch's engine, which inputs a backward will use, and the
compositions that define composite ops."""
