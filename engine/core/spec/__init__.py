"""Speculative decoding in the scheduler core: drafts (n-gram lookup) and when to speculate (adaptive k)."""
