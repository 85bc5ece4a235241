"""Model lifecycle of a board daemon: the package gate, signatures, generations (issue 12)."""
