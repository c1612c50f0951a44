"""The parsed configuration (:class:`Config`) that :func:`ddl.core.config.load` returns,
and what the autotuner may change in it while a job runs (:data:`TUNABLE`).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

# What the autotuner may change while a job runs (Config.tune), as TuningSetting fields.
TUNABLE = ("fusion_threshold", "small_message_bytes", "tcp_chunk_bytes",
           "hierarchical_allreduce", "shm_allreduce_algorithm")


class Config:
    """Parsed configuration: one attribute per variable key (``cfg.fusion_threshold``);
    ``notes``: what the program should be told once (``HOROVOD_*`` variables read as
    aliases, ignored, or overridden)."""

    def __init__(self, values: Mapping[str, Any], notes: Sequence[str] = ()):
        self._values = dict(values)
        self.__dict__["notes"] = list(notes)

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def as_dict(self) -> Dict[str, Any]:
        return dict(self._values)

    def tune(self, setting_id: int, values: Mapping[str, Any]) -> None:
        """Take the autotuner's setting ``setting_id`` (keys of :data:`TUNABLE`), in place:
        the one change a loaded Config sees. Every rank calls it before executing the
        first response stamped with that setting (:mod:`ddl.runtime.execute`), so all
        members of a collective run it with the same values."""
        unknown = set(values) - set(TUNABLE)
        if unknown:
            raise ValueError(f"not tunable: {sorted(unknown)}")
        self._values.update(values)
        self.__dict__["tuning_id"] = setting_id

    @property
    def tuning_id(self) -> int:
        """The autotuner's setting this rank last took (0: none, its own configuration)."""
        return self.__dict__.get("tuning_id", 0)

    def replace(self, **values: Any) -> "Config":
        """A copy with ``values`` (keys of the table) in place of this one's."""
        return Config(dict(self._values, **values), self.notes)

    def __repr__(self) -> str:
        shown = {k: ("<hidden>" if k == "job_secret" and v else v) for k, v in self._values.items()}
        return f"Config({shown})"
