"""Requests with `n` > 1 at the balancer: one upstream request to one board, its choices' client streams.

The board computes the prompt once and sends each choice's events with its
`index` (docs/protocol.md, "Several choices"); the balancer keeps the choices
together: the request goes whole to one backend and each choice's events go to
that choice's client stream. Until a choice has shown anything the request is
retried like any other; once one has, it is not migrated (a choice's
continuation would be another choice's), so a broken stream then fails every
choice not ended yet (503 `stream_broken`, retryable).
"""

from __future__ import annotations

import dataclasses

from engine.balancer.actions import EmitTokens, FailRequest, FinishRequest


class ChoiceGroups:
    def __init__(self) -> None:
        self._rids: dict[int, list[int]] = {}  # the core's request -> every choice's client stream
        self._open: dict[int, set[int]] = {}  # -> indices not ended yet
        self._started: set[int] = set()  # requests of which some choice has shown something
        self._leader: dict[int, int] = {}  # choice's stream -> the core's request

    def add(self, rid: int, rids: list[int]) -> None:
        """Core request `rid` (an id of its own, so its whole-request terminal event is told from choice 0's)
        is the choices `rids` of the client's streams."""
        self._rids[rid] = list(rids)
        self._open[rid] = set(range(len(rids)))
        for r in rids:
            self._leader[r] = rid

    def leader(self, rid: int) -> int:
        """The core request of client stream `rid` (itself when it is not a choice)."""
        return self._leader.get(rid, rid)

    def started(self, rid: int) -> bool:
        return rid in self._started

    def forget(self, rid: int) -> None:
        for r in self._rids.pop(rid, ()):
            self._leader.pop(r, None)
        self._open.pop(rid, None)
        self._started.discard(rid)

    def on_event(self, rid: int, ev: dict) -> tuple[list, bool] | None:
        """A board event of group `rid`: (actions for its choice, whether every choice has ended), or None
        for the core to handle as a whole-request event (an error before any choice showed anything)."""
        rids = self._rids.get(rid)
        k = ev.get("index")
        kind = ev["ev"]
        if rids is None or type(k) is not int or not 0 <= k < len(rids):
            return None
        if kind == "error" and rid not in self._started:
            return None
        self._started.add(rid)
        crid = rids[k]
        out: list = []
        if kind == "tokens" or (kind == "done" and ev.get("tokens")):
            out.append(EmitTokens(crid, ev.get("tokens") or [], ev.get("logprobs"), ev.get("text"),
                                  ev.get("top_logprobs"), ev.get("prompt_logprobs")))
        if kind == "tokens":
            return out, False
        if kind == "done":
            out.append(FinishRequest(crid, ev["finish_reason"], ev.get("usage") or {}, ev.get("timing") or {}))
        else:
            out.append(FailRequest(crid, ev["code"], ev["reason"], ev["message"], bool(ev.get("retryable")),
                                   retry_after_ms=ev.get("retry_after_ms")))
        left = self._open[rid]
        left.discard(k)
        if left:
            return out, False
        self.forget(rid)
        return out, True

    def fan(self, actions: list) -> list:
        """The core's actions with a whole-request terminal event of a group given to each choice not ended."""
        if not self._rids:
            return actions
        out = []
        for a in actions:
            rid = getattr(a, "request_id", None)
            if type(a) in (FinishRequest, FailRequest) and rid in self._rids:
                rids = self._rids[rid]
                for k in sorted(self._open[rid]):
                    out.append(_with_rid(a, rids[k]))
                self.forget(rid)
            else:
                out.append(a)
        return out


def _with_rid(a, rid: int):
    return dataclasses.replace(a, request_id=rid)
