"""A bound on how deeply a client's JSON text nests, checked before it is parsed.

Python's JSON decoder recurses once per level: text nested past the interpreter's recursion limit (`"[" * 100000`
is 100 kB, well under the message size limit) raises RecursionError, and anything that walks the parsed value
recurses as deep. A client event is never nested more than a few levels (a session's settings are the deepest,
at about six), so text nested past MAX_DEPTH is refused as `invalid_json` before any parsing.
"""

from __future__ import annotations

import numpy as np

MAX_DEPTH = 64

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENS, _CLOSES = (ord("["), ord("{")), (ord("]"), ord("}"))


def deeper_than(text: str | bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether `text`, read as JSON, opens more than `limit` arrays and objects inside one another (brackets inside
    strings do not count). Vectorised: a hostile 1 MiB message costs tens of milliseconds, not a Python loop per
    byte; any other message costs two substring counts."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    b = np.frombuffer(data, dtype=np.uint8)
    quote = b == _QUOTE
    after_backslash = np.flatnonzero(quote[1:] & (b[:-1] == _BACKSLASH)) + 1
    if len(after_backslash):  # a quote after an odd run of backslashes is escaped
        pos = np.arange(len(b), dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(b != _BACKSLASH, pos, -1))
        run = after_backslash - 1 - last_other[after_backslash - 1]
        quote[after_backslash[run % 2 == 1]] = False
    # Inside a string from just after its opening quote to its closing quote.
    flips = np.zeros(len(b), dtype=np.int8)
    flips[1:] = quote[:-1]
    outside = (np.cumsum(flips, dtype=np.int32) & 1) == 0
    step = ((b == _OPENS[0]) | (b == _OPENS[1])).view(np.int8) - ((b == _CLOSES[0]) | (b == _CLOSES[1])).view(np.int8)
    step[~outside] = 0
    return bool(np.cumsum(step, dtype=np.int32).max() > limit)
