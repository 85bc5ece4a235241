"""Model lifecycle of a board daemon: the package gate, signatures, generations (docs/models.md#model-lifecycle)."""
