"""Horovod's environment variables: which are read as their ``DDL_*`` twins, which are a
rank's identity, and the notes that tell the program what was read, ignored or
overridden. :func:`ddl.core.config.horovod_aliases` applies them to an environment.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from ddl.core._config_var import Var
from ddl.core.errors import ConfigError

# Horovod's variables that have a ddl meaning: each is read as its DDL_* twin (the twin
# wins when both are set, and the conflict is reported); the others are reported once as
# ignored. HOROVOD_STALL_CHECK_DISABLE=1 turns both stall times to 0.
HOROVOD_ALIASES = {
    "HOROVOD_FUSION_THRESHOLD": "DDL_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME": "DDL_CYCLE_TIME_MS",
    "HOROVOD_CACHE_CAPACITY": "DDL_CACHE_CAPACITY",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "DDL_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "DDL_HIERARCHICAL_ALLGATHER",
    "HOROVOD_TIMELINE": "DDL_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES": "DDL_TIMELINE_MARK_CYCLES",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "DDL_STALL_CHECK_TIME_SECONDS",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "DDL_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_START_TIMEOUT": "DDL_START_TIMEOUT",
    "HOROVOD_LOG_LEVEL": "DDL_LOG_LEVEL",
    "HOROVOD_AUTOTUNE": "DDL_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG": "DDL_AUTOTUNE_LOG_FILE",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "DDL_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "DDL_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "DDL_AUTOTUNE_MAX_SAMPLES",
}
# What Horovod's launchers tell each rank, which scripts read (``os.environ['HOROVOD_RANK']``):
# ddl.init() sets them from the job's topology (and ddlrun what it knows at start); ddl
# never reads them, and they are not reported as ignored.
HOROVOD_IDENTITY = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                    "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
                    "HOROVOD_HOSTNAME")


def horovod_identity(**values: Any) -> Dict[str, str]:
    """The HOROVOD_* identity variables of a rank, from ``rank``, ``size``,
    ``local_rank``, ``local_size``, ``cross_rank``, ``cross_size`` and ``hostname`` (those
    given)."""
    out = {f"HOROVOD_{key.upper()}": str(value) for key, value in values.items()}
    unknown = set(out) - set(HOROVOD_IDENTITY)
    if unknown:
        raise ValueError(f"not a Horovod identity variable: {sorted(unknown)}")
    return out


_HOROVOD_SWITCHES = {
    "HOROVOD_STALL_CHECK_DISABLE": {"DDL_STALL_CHECK_TIME_SECONDS": "0",
                                    "DDL_STALL_SHUTDOWN_TIME_SECONDS": "0"},
}


def _same_value(var: Var, a: str, b: str) -> bool:
    """Whether texts ``a`` and ``b`` mean the same value of ``var`` (5 and 5.0)."""
    try:
        return var.parse(a) == var.parse(b)
    except (ConfigError, ValueError):
        return a == b


def read_twins(env: Mapping[str, str], variables: Mapping[str, Var]
               ) -> Tuple[Dict[str, str], Dict[str, str], List[str]]:
    """:func:`ddl.core.config.horovod_aliases`, with ``variables`` the table by name."""
    out, origin, notes = dict(env), {}, []
    twins = dict((h, {d: env[h]}) for h, d in HOROVOD_ALIASES.items() if h in env)
    if env.get("HOROVOD_TIMELINE") == "DYNAMIC":   # Horovod's "no file now, maybe later"
        del twins["HOROVOD_TIMELINE"]
        notes.append("HOROVOD_TIMELINE=DYNAMIC: no timeline at the start; "
                     "ddl.start_timeline(path) starts one")
    for h, sets in _HOROVOD_SWITCHES.items():
        if h in env and env[h].strip().lower() in ("1", "true", "yes", "on"):
            twins[h] = sets
    for h, sets in twins.items():
        for d, value in sets.items():
            if d in env:
                if not _same_value(variables[d], env[d], value):
                    notes.append(f"{h}={env[h]} is overridden by {d}={env[d]}")
            elif d in origin:
                notes.append(f"{h}={env[h]} is overridden by {origin[d]}")
            else:
                out[d], origin[d] = value, h
    if origin:
        notes.append("read as ddl settings: " + ", ".join(
            f"{h} as {d}" for d, h in sorted(origin.items())))
    ignored = sorted(k for k in env if k.startswith("HOROVOD_")
                     and k not in HOROVOD_ALIASES and k not in _HOROVOD_SWITCHES
                     and k not in HOROVOD_IDENTITY)
    if ignored:
        notes.append(f"ignored (no meaning in ddl): {', '.join(ignored)}")
    return out, origin, notes
