"""Prefill/decode hand-off between boards: the intake of a generate's `handoff`, the holds, and the two ways
a decode board reads the blocks (another board's host slot pool on this host, a KV pull over zmq)."""
