"""Reading JSON as it is written: where a value that may still be growing ends, without parsing it.

A model's output arrives a few characters at a time; ``pagedkv.tool_calls`` needs to know, on each text so far, which
strings, arrays, objects, numbers and literals are complete. These scanners answer that with indices (None while a
value is open) and never raise on partial input; ``value_end``'s memo lets a stream read each character of an array
or object once as the same text grows.
"""

from __future__ import annotations

WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace (len(text): none)."""
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """The index after the JSON string opening at ``text[i]`` ('"'), None while it is open."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int, final: bool, memo: dict | None = None) -> int | None:
    """The index after the JSON value starting at ``text[i]``, None while it is incomplete (a number or literal ends
    at a delimiter, or at the end of a final text). ``memo``: where earlier calls on shorter texts (the same text,
    grown) left each array or object, so that a stream reads each character of one once."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        return container_end(text, i, {} if memo is None else memo)
    j = i
    while j < len(text) and text[j] not in WS + ",]}":
        j += 1
    return j if j < len(text) or final else None


def container_end(text: str, i: int, memo: dict) -> int | None:
    """The index after the array or object opening at ``text[i]``, None while it is open; read on from where
    ``memo`` left it (its end once known, else the position, depth and whether inside a string)."""
    state = memo.get(i)
    if isinstance(state, int):
        return state
    j, depth, in_string = state or (i, 0, False)
    n = len(text)
    while j < n:
        c = text[j]
        if in_string:
            if c == "\\":
                j += 2  # (past the end when the escape is the last character: the next read starts after it)
                continue
            if c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                memo[i] = j + 1
                return j + 1
        j += 1
    memo[i] = (j, depth, in_string)
    return None
