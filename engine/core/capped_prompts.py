"""The prompt chunks of a mixed job while decode lanes run, within `prompt_tokens_while_decoding`.

The running streams wait for every such job, so its prompt tokens are
capped; what goes in that room decides both how long a stream waits and
whether a long prompt progresses. A stream's next request is a short prompt
that the stream waits on exactly like a skipped decode step (its gap runs
from its last token to that prompt's first), so prompts that fit the room
whole go first; a prompt above the room (or above `prefill_chunk_tokens`: it
only goes in chunks), and one already chunked, keeps at least half of it, so
it progresses in every job however many short prompts arrive, and its chunk
fills whatever the whole prompts leave. A short prompt is not split to fill
a remainder (as without the cap): it goes whole in a later job. Within a
class first come, first served (a chunked prompt's next chunk heads its
class, so two long prompts finish one after the other); across classes the
prefill classes' weighted round robin. A prompt that cannot be chunked (its
whole prompt is needed at once) and is above the room still goes whole as a
job's first prompt, as without the cap: it could never go otherwise.

A burst's job (no stream on the chip past its first token, so its budget
is `batch.burst_token_budget`) is filled the same way with the chunks held
to the cap: the burst's room beyond it is for whole prompts, which share one
pass over the weights, while a long prompt's chunks would only make every
stream of the burst wait longer for its first token.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.core.logprob_asks import whole_prompt
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin, WorkClass
from engine.core.request_record import RequestRecord

PromptChunk = tuple[RequestRecord, int, int]  # (request, start, end): the prompt positions a job computes


def take_capped(queues: PrefillQueues, wrr: SmoothWeightedRoundRobin, requests: Mapping[int, RequestRecord],
                room: int, top: int, chunk: int, chunk_room: int | None = None, lanes_wait: bool = False
                ) -> tuple[list[PromptChunk], int]:
    """Prompt chunks for `room` prompt tokens (at most `top` prompts, chunks of at most `chunk`); returns
    them and the room left (negative: an unchunkable prompt above the room, alone). With `chunk_room` (a
    burst's job, whose room beyond it is for whole prompts), chunks take at most that many tokens in all
    once anything waits for the job: decode lanes in it (`lanes_wait`) or a whole prompt taken."""
    prompts: list[PromptChunk] = []
    left = room
    chunk_left = room if chunk_room is None else chunk_room
    held = lanes_wait  # streams wait for this job's chunks (held to chunk_room): its lanes, its whole prompts

    def heads() -> list[tuple[WorkClass, RequestRecord, int, bool]]:
        """(class, its first request, the tokens it still needs, whether it may be chunked)"""
        out = []
        for c in queues.nonempty():
            r = requests[queues.members(c)[0]]
            out.append((c, r, r.prefill_target - r.committed, not whole_prompt(r)))
        return out

    def take(cls: WorkClass, r: RequestRecord, n: int) -> None:
        nonlocal left
        queues.pop(cls)
        prompts.append((r, r.committed, r.committed + n))
        left -= n

    long = min(room, chunk)

    def holders(hs) -> dict[WorkClass, tuple[RequestRecord, int]]:
        """Heads that go in chunks: above `long`, or a prompt already chunked (its tail fills the rest)."""
        return {c: (r, n) for c, r, n, ok in hs if ok and (n > long or r.committed > r.cached_tokens)}

    reserve = min(room // 2, chunk_left) if holders(heads()) else 0
    while left > 0 and len(prompts) < top:
        hs = heads()
        split = holders(hs)
        whole = {c: (r, n) for c, r, n, ok in hs if c not in split and (
            (n <= left - reserve and (n <= chunk or not ok)) or (not ok and not prompts and n > left - reserve))}
        if whole:
            cls = wrr.pick(list(whole))
            assert cls is not None
            take(cls, *whole[cls])
            held = True
            continue
        reserve = 0  # the whole prompts are in: the rest goes to a chunk
        if not split or (held and chunk_left <= 0):
            break  # a short prompt is not split to fill the rest: it goes whole in a later job
        cls = wrr.pick(list(split))
        assert cls is not None
        r, n = split[cls]
        n = min(left, chunk, n, chunk_left) if held else min(left, chunk, n)
        chunk_left -= n
        take(cls, r, n)
    return prompts, left
