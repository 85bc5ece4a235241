"""What a harness raises when a decoder broke its contract without crashing on its own."""

from __future__ import annotations


class Finding(AssertionError):
    """A contract break: a foreign exception, or an accepted value outside the documented ranges.

    Its message is "what broke | the input": the driver tells findings apart by what broke."""
