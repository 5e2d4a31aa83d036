"""The conversation's items in the engine service: the rows each item is, an item deleted (the history after it
prefilled again), and the oldest items dropped when the next turn would not fit the context (SetTruncation).

A session's history is its conversation's rows in the engine, then the rows still due (Session.close_rows and
pending_rows). Its turns start at `<|im_start|>` rows: the first system turn (once sent), then one per Session.items
entry, in order. Items change only between turns (no request live, no answer completing, no commit in flight): the
conversation is cut in the engine before the first item dropped, and the turns after it go back as pending rows,
prefilled again with the session's next request as background work (Scheduler), which no answer waits for.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.process.errors import ServiceError
from engines.process.prompt import PromptBuilder
from engines.process.sessions import Item, Session
from engines.protocol import errors
from engines.protocol import messages as m
from engines.tokens import Row

log = logging.getLogger("engines.process")

# Rows kept free for a user audio turn opened at its first code (20 s of speech); a longer turn may still not fit.
AUDIO_TURN_RESERVE = 250


class History:
    """Part of Service (service.py): the items of each session's history. Calls Service's _session and Outputs'
    _send (outputs.py)."""

    engine: Any
    prompts: PromptBuilder
    sessions: dict[str, Session]

    def _on_SetTruncation(self, client: bytes, msg: m.SetTruncation) -> None:
        s = self._session(client, msg.session_id)
        r = msg.retention_ratio
        if r is not None and (not m.number_in(r, 0.0, 1.0) or r == 0):
            raise ServiceError(errors.INVALID_REQUEST, f"retention_ratio must be in (0, 1] or None, got {r!r}")
        s.retention = r

    def _on_DeleteItem(self, client: bytes, msg: m.DeleteItem) -> None:
        s = self._session(client, msg.session_id)
        if self._mid_turn(s):
            raise ServiceError(errors.ITEM_DELETE_MID_TURN, "an item can be deleted only between turns, not while a "
                               "user turn (committed and not yet answered, too) or an answer is in progress")
        i = next((i for i, it in enumerate(s.items) if it.item_id == msg.item_id), None)
        if i is None:
            raise ServiceError(errors.INVALID_REQUEST, f"no item {msg.item_id!r} in this session's history (the "
                               "first system item is the system prompt)")
        self._drop(s, [i])
        self._send(s.owner, m.ItemsDropped(s.session_id, [msg.item_id], deleted=True))

    @staticmethod
    def _mid_turn(s: Session) -> bool:
        """A turn is in progress: a request live, an answer completing, a commit in flight, speech codes due, or a
        tentative commit not yet confirmed (a withdrawal truncates back to rows a cut would move) or withdrawn."""
        return (s.active is not None or s.completing is not None or s.commit_pending is not None
                or bool(s.pending_codes) or s.tentative is not None or s.reopened is not None)

    # ---- the ledger ------------------------------------------------------------------------------------------

    def _add_item(self, s: Session, item_id: str | None, pinned: bool = False) -> None:
        s.items.append(Item(item_id, pinned))

    def _audio_turn_in(self, s: Session) -> None:
        """A user audio turn's rows entered the history (its request opened, or the whole turn is pending)."""
        if s.audio_item is None:
            s.audio_item = Item(None)
            s.items.append(s.audio_item)

    def _audio_turn_named(self, s: Session) -> None:
        """The audio turn in the history was committed: it is the commit's item."""
        if s.audio_item is not None:
            s.audio_item.item_id, s.audio_item = s.commit_item, None
        s.commit_item = None

    def _audio_turn_out(self, s: Session) -> None:
        """The uncommitted audio turn was cleared."""
        if s.audio_item is not None:
            s.items.remove(s.audio_item)
            s.audio_item = None

    def _turn_spans(self, s: Session) -> tuple[int, list[Row], list[tuple[int, int]]]:
        """(rows in the engine, the whole history, each item's [start, end) in it)."""
        conv = self.engine.conversation_history(s.conversation_id)
        hist = conv + s.close_rows + s.pending_rows
        starts = self.prompts.turn_starts(hist)
        lead = 1 if s.system_sent else 0
        # A user audio turn whose request was undone waits as codes, not rows: the last item, still empty (a
        # withdrawn turn, open again, keeps its rows in the conversation).
        waiting = int(s.active is None and s.reopened is None and s.audio_item is not None
                      and s.items[-1:] == [s.audio_item])
        n = len(s.items) - waiting
        if len(starts) != n + lead or (hist and starts[:1] != [0]):
            raise ServiceError(errors.ENGINE_ERROR, f"the history's {len(starts)} turns do not match its "
                               f"{n} items; it cannot be cut")
        bounds = starts + [len(hist)] * (1 + waiting)
        return len(conv), hist, [(bounds[lead + i], bounds[lead + i + 1]) for i in range(len(s.items))]

    def _drop(self, s: Session, drop: list[int]) -> None:
        """Drop these items (indices of s.items): the conversation is cut before the first, the turns after it that
        stay go back as pending rows (those that were history, as background work: Session.refill_rows)."""
        n_conv, hist, spans = self._turn_spans(s)
        gone = set(drop)
        first = spans[min(gone)][0]
        due_at = n_conv + len(s.close_rows)  # where the pending rows start
        refill_end = due_at + s.refill_rows  # rows before this were history (in the engine, or to prefill again)
        kept: list[Row] = []
        refill = 0
        for i, (a, b) in enumerate(spans):
            if i in gone or a < first:
                continue
            kept += hist[a:b]
            refill += max(0, min(b, refill_end) - a)
        s.items = [it for i, it in enumerate(s.items) if i not in gone]
        if first >= due_at:  # only rows still due change
            s.pending_rows = hist[due_at:first] + kept
            s.refill_rows = min(s.refill_rows, first - due_at) + refill
            return
        self.engine.truncate_conversation(s.conversation_id, first)
        s.close_rows, s.pending_rows, s.refill_rows = [], kept, refill
        if s.answer is not None:  # its rows moved: it can no longer be truncated
            s.moved_answer, s.answer = s.answer.response_id, None

    # ---- fitting the context ---------------------------------------------------------------------------------

    def _over(self, s: Session, new_rows: int) -> bool:
        """The conversation in the engine and `new_rows` more (everything due, a new turn, an answer budget) would
        not fit the context."""
        config = getattr(self.engine, "config", None)
        return config is not None and self.engine.conversation_rows(s.conversation_id) + new_rows > \
            config.max_model_len

    def _cut_to_fit(self, s: Session, new_rows: int) -> bool:
        """Before a request of `new_rows` rows (all that is due included): drop the oldest items, but for pinned ones
        and the newest, until the conversation takes at most its retention share of the context. False: truncation
        is off, or dropping cannot make it fit (the request is then refused as too large)."""
        if s.retention is None or not self._over(s, new_rows):
            return False
        if s.tentative is not None or s.reopened is not None:
            return False  # a withdrawal truncates back to rows a cut would move
        limit = self.engine.config.max_model_len
        try:
            _, _, spans = self._turn_spans(s)
        except ServiceError as e:
            log.warning("session %s: %s", s.session_id, e)
            return False
        total = self.engine.conversation_rows(s.conversation_id) + new_rows
        drop = []
        for i, it in enumerate(s.items[:-1]):
            if total <= s.retention * limit:
                break
            if not it.pinned and it is not s.audio_item:
                drop.append(i)
                total -= spans[i][1] - spans[i][0]
        if not drop or total > limit:
            return False
        ids = [s.items[i].item_id for i in drop]
        self._drop(s, drop)
        log.info("session %s: dropped %d items (%d rows) to fit the context", s.session_id, len(drop),
                 sum(spans[i][1] - spans[i][0] for i in drop))
        self._send(s.owner, m.ItemsDropped(s.session_id, [i for i in ids if i is not None], deleted=False))
        return True

    @staticmethod
    def _refill_lead(s: Session, lead_before_pending: int) -> int:
        """Leading rows of a new request that are history prefilled again (`lead_before_pending`: its rows before
        the pending ones); the caller clears Session.refill_rows once the request is in."""
        return lead_before_pending + s.refill_rows if s.refill_rows else 0
