"""The launcher: ``ddlrun`` (:mod:`ddl.launcher.cli`) and :func:`ddl.run`."""

from ddl.launcher.run_fn import RunError as RunError
from ddl.launcher.run_fn import run as run

__all__ = ["RunError", "run"]
