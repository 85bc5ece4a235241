"""KV sequence states and the legal transitions between them.

The table is data so that the manager and the tests check the same rules.
"""

from __future__ import annotations

import enum


class KvSequenceState(enum.Enum):
    FREE = "free"  # no entry: the seq_id holds nothing
    RESERVED = "reserved"  # blocks allocated, no job has written yet (cached prefix may be present)
    ACTIVE = "active"  # committed KV present, no job in flight
    UPDATING = "updating"  # a job writing positions committed_len..pending_len is in flight
    UNKNOWN = "unknown"  # a job failed / timed out or the chip faulted: KV content not trusted
    RELEASING = "releasing"  # transient, inside release()

    __hash__ = object.__hash__  # members are singletons; Enum's name hash is slow on the hot path


S = KvSequenceState

LEGAL_TRANSITIONS: dict[KvSequenceState, frozenset[KvSequenceState]] = {
    S.FREE: frozenset({S.RESERVED}),
    S.RESERVED: frozenset({S.UPDATING, S.RELEASING, S.UNKNOWN}),
    S.ACTIVE: frozenset({S.UPDATING, S.RELEASING, S.UNKNOWN}),
    S.UPDATING: frozenset({S.ACTIVE, S.UNKNOWN, S.RELEASING}),
    S.UNKNOWN: frozenset({S.FREE}),  # dropped by release() or recover_chip(); blocks stay quarantined
    S.RELEASING: frozenset({S.FREE}),
}


class KvStateError(Exception):
    """An operation was asked of a sequence in a state that does not allow it (a caller bug)."""


def check_transition(old: KvSequenceState, new: KvSequenceState) -> None:
    if new not in LEGAL_TRANSITIONS[old]:
        raise KvStateError(f"illegal KV transition {old.name} -> {new.name}")
