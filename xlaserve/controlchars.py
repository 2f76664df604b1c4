"""Text a peer wrote, made safe to show on a terminal: its control characters as ``\\xNN``.

A worker's output, a model's name (a bundle directory's name), a peer's status: any of them may
hold an ESC, which a terminal reads as the start of an escape sequence (moving the cursor,
clearing the screen, retitling the window), or a CR, which returns to the start of the line and
lets what follows hide what came before. Whatever shows such text to an operator (the
supervisor's text logs, ``xlaserve top``) writes it through :func:`show_controls` first. Kept
free of imports beyond the standard library, so both the server and the dashboard can use it.
"""
from __future__ import annotations

import re

#: C0 (U+0000-U+001F), DEL (U+007F) and C1 (U+0080-U+009F): U+009B is a one-character CSI to a
#: terminal that honours C1 controls, as an ESC ``[`` is to every one.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def show_controls(text: str, keep: str = "") -> str:
    """``text`` with every control character except those in ``keep`` written as ``\\xNN``
    (ESC becomes the four characters ``\\x1b``); ``text`` itself when it has none. Log lines keep
    ``"\\t"`` (and a multi-line record ``"\\n"``), which move the cursor forward but cannot hide or
    rewrite anything; the dashboard keeps none, since a tab would break its columns."""
    if not CONTROL_CHARACTERS.search(text):
        return text
    return CONTROL_CHARACTERS.sub(
        lambda m: m.group() if m.group() in keep else f"\\x{ord(m.group()):02x}", text)
