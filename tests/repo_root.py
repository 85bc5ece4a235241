"""The repository's root: the working directory of every process a test starts, and where its files are."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
