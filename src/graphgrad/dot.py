"""Writing Graphviz DOT text: quoting, HTML-like labels, attribute lists, sizes in bytes.

One set of helpers for every picture graphgrad draws: autograd graphs (viz.py) and captured
plans (capture/picture.py).
"""

from __future__ import annotations

import html

__all__ = ["Html", "escape", "quote", "attributes", "human_bytes"]


class Html(str):
    """A label already written as Graphviz HTML-like text (emitted as ``<...>``, not quoted)."""


def escape(text) -> str:
    """``text`` made safe inside an HTML-like label."""
    return html.escape(str(text), quote=True)


def quote(text) -> str:
    """``text`` as a double-quoted DOT string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def attributes(attrs: dict) -> str:
    """``key=value, ...`` for a node or edge statement (``Html`` values unquoted)."""
    out = []
    for key, value in attrs.items():
        out.append(f"{key}=<{value}>" if isinstance(value, Html) else f"{key}={quote(value)}")
    return ", ".join(out)


def human_bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
