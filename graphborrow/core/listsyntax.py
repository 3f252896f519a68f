"""Comma lists whose items may themselves be bracketed lists: ``1,[64,32],x``.

Used for allocator settings (``roundup_power2_divisions:[256:1,>:4],max_split_size_mb:40``)
and for sweep values on the command line (``-p LADDER [8,4],[16,8]``).
"""

__all__ = ["split_top_level"]


def split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets; items come back stripped, empty ones dropped."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]
