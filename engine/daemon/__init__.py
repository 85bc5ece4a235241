"""The board daemon: the I/O shell around the sans-I/O scheduler core."""
