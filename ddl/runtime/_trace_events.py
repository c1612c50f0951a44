"""The text of one Chrome-trace event (Trace Event Format): compact, ASCII-only JSON of at
most :data:`MAX_EVENT_BYTES`, so that :class:`~ddl.runtime._trace_file.TraceFile` can
write it inside one page.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Optional

from ddl.runtime._trace_file import PAGE_BYTES

MAX_EVENT_BYTES = PAGE_BYTES - 2  # ",\n" + event fits one page


def _plain(value: Any) -> Any:
    """``json.dumps`` fallback: NumPy scalars become Python numbers, the rest ``str``."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)


_ARGS_ENCODER = json.JSONEncoder(default=_plain, separators=(",", ":"), allow_nan=False)


def _args_json(args: Mapping[str, Any]) -> str:
    """``args`` as compact, ASCII-only JSON; values JSON cannot hold become strings."""
    try:
        return _ARGS_ENCODER.encode(args)
    except (TypeError, ValueError):  # NaN, a non-string key, a cycle
        return json.dumps({str(k): repr(v) for k, v in args.items()}, separators=(",", ":"))


def _ts(ns: int) -> str:
    """Nanoseconds as the microsecond text of ``ts`` (exact, three decimals)."""
    return f"{ns // 1000}.{ns % 1000:03d}"


@functools.lru_cache(maxsize=4096)
def _quote(name: str) -> str:
    """``name`` as a JSON string, ASCII only (cached: phase and tensor names repeat)."""
    return json.dumps(name)


def _event(ph: str, name: str, pid: int, tid: int, ns: int, args_text: str = "",
           extra: str = "") -> str:
    """:func:`event_json` with ``args`` already rendered by :func:`_args_json` (or
    ``""``), so that the events of one fused record share one rendering."""
    head = f',"ph":"{ph}","ts":{_ts(ns)},"pid":{pid},"tid":{tid}{extra}'
    body = f',"args":{args_text}' if args_text else ""
    text = f'{{"name":{_quote(name)}{head}{body}}}'
    if len(text) > MAX_EVENT_BYTES:
        body = f',"args":{{"args_bytes":{len(args_text)}}}' if args_text else ""
        text = f'{{"name":{_quote(name)}{head}{body}}}'
    if len(text) > MAX_EVENT_BYTES:
        text = f'{{"name":{json.dumps(name[:256] + "...")}{head}{body}}}'
    return text


def event_json(ph: str, name: str, pid: int, tid: int, ns: int,
               args: Optional[Mapping[str, Any]] = None, extra: str = "") -> str:
    """One event as JSON text of at most :data:`MAX_EVENT_BYTES`, ASCII only (so its
    length in characters is its size in bytes). ``extra`` is appended verbatim inside the
    object (e.g. ``,"s":"t"``). If the event would be larger, ``args`` become
    ``{"args_bytes": <size of the args>}`` and a very long name is cut."""
    return _event(ph, name, pid, tid, ns, _args_json(args) if args else "", extra)
