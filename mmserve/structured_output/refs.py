"""Local `$ref`s: JSON pointers, and where a reference points."""

from __future__ import annotations

import re
from typing import Any

_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")  # RFC 6901: no leading zeros


def pointer_join(pointer: str, token: str | int) -> str:
    """RFC 6901: `pointer` extended by one reference token."""
    return f"{pointer}/{str(token).replace('~', '~0').replace('/', '~1')}"


def resolve_local_ref(root: Any, ref: Any) -> tuple[str, Any] | None:
    """A local reference ("#" or "#/...") -> (the JSON pointer it names, escaped as
    pointer_join does, and the value there); None if it is not local or does not resolve."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target, pointer = root, ""
    for token in ref[2:].split("/") if ref != "#" else ():
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and key in target:
            target, pointer = target[key], pointer_join(pointer, key)
        elif isinstance(target, list) and _ARRAY_INDEX.fullmatch(key) and int(key) < len(target):
            target, pointer = target[int(key)], pointer_join(pointer, key)
        else:
            return None
    return pointer, target
