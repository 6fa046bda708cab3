"""Text from peers made safe for a log line: what a role logs about a message it dropped may
quote the message (an ``env_key``, a decode error), and a peer must not be able to forge log
lines, hide text with terminal escapes or fill the log with one message."""

from __future__ import annotations

MAX_CHARS = 300
"""The most characters of one such text a log line keeps."""


def loggable(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` on one line: newlines, terminal escapes and every other unprintable character
    escaped as ``repr`` escapes them, cut to ``limit`` characters (saying how many more)."""
    more = len(text) - limit
    if more > 0:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text + (f"... ({more} more characters)" if more > 0 else "")
