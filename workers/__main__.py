"""`python -m workers CONFIG_JSON`: the worker process entry point (see workers.main)."""

from __future__ import annotations

import sys

from workers.main import main

sys.exit(main())
