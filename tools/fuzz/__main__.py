"""`python -m tools.fuzz`: the same as `npuserve fuzz`."""

import sys

from tools.fuzz.main import main

sys.exit(main())
