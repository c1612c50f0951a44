"""One configuration variable: its declaration (:class:`Var`) and the strict parsing of
its text (a bad value raises :class:`~ddl.ConfigError` naming the variable and the
value). The table of every variable is :data:`ddl.core.config.VARIABLES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ddl.core.errors import ConfigError


def _parse_int(text: str) -> int:
    return int(text.strip(), 10)


def _parse_float(text: str) -> float:
    value = float(text.strip())
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("not a finite number")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True)
class Var:
    """One configuration variable.

    ``key`` is the attribute name on :class:`~ddl.core.config.Config`; ``flag`` the
    ``ddlrun`` flag (or ``""``) and ``short`` its one-letter spelling; ``repeat``: the
    flag may be given several times, and the variable holds the values separated by
    commas; ``internal`` marks variables that the launcher sets for its workers and users
    normally do not; ``minimum`` bounds numbers from below; ``choices`` restricts strings.
    """

    name: str
    key: str
    kind: str  # "int" | "float" | "bool" | "str" | "choice"
    default: Any
    doc: str
    flag: str = ""
    internal: bool = False
    minimum: Optional[float] = None
    choices: Sequence[str] = ()
    short: str = ""
    repeat: bool = False

    def parse(self, text: str) -> Any:
        """Parse ``text`` strictly; ``ConfigError`` names this variable and the value."""
        try:
            if self.kind == "int":
                value: Any = _parse_int(text)
            elif self.kind == "float":
                value = _parse_float(text)
            elif self.kind == "bool":
                value = _parse_bool(text)
            elif self.kind == "choice":
                value = text.strip().lower()
                if value not in self.choices:
                    raise ValueError(f"expected one of {', '.join(self.choices)}")
            else:
                value = text
        except ValueError as exc:
            raise ConfigError(
                f"{self.name}={text!r} is not valid: {exc}"
                + (f" (it is also set by ddlrun {self.flag})" if self.flag else ""),
                variable=self.name, value=text) from None
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{self.name}={text!r} is not valid: must be >= {self.minimum:g}",
                              variable=self.name, value=text)
        return value


Parser = Callable[[str], Any]
