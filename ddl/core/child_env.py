"""The environment of a process that ddl starts in another working directory."""

from __future__ import annotations

import os
from typing import Dict, Mapping


def absolute_pythonpath(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` with each relative ``PYTHONPATH`` entry made absolute against this
    process's working directory (an empty entry means that directory), so that a child
    started elsewhere (a coordinator in its job directory) imports what this one does."""
    out = dict(env)
    path = out.get("PYTHONPATH")
    if path:
        out["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir)
                                            for p in path.split(os.pathsep))
    return out
