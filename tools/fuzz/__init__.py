"""Coverage-guided fuzzing (atheris) of the parsers that read untrusted or foreign bytes.

Each harness module holds one contract: `SEEDS` (valid inputs the corpus starts from), `one_input(data)`
(returns when the decoder kept its contract, raises `Finding` or any other exception when it did not),
and optionally `mutate` (a structure-aware
mutator). `tools.fuzz.run_one` runs one harness under libFuzzer in its own process (libFuzzer exits on
a finding); `tools.fuzz.main` (`npuserve fuzz`, `make fuzz`) drives them. See docs/fuzzing.md.
"""

from __future__ import annotations

HARNESSES = ("wire_request", "wire_event", "http_request", "job_record", "ring_record")
# The packages whose code is instrumented for coverage (every harness's decoders live in them).
INSTRUMENT = ("ipc", "engine.http")
