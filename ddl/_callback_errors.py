"""ddl's typed errors through a framework's compiled program.

A client runs a collective inside a compiled program as a host callback
(``tf.numpy_function``, ``jax.experimental.io_callback``). When the collective raises
(``PeerLostError``, ``MismatchError``...), the framework raises its own error instead
(``tf.errors.UnknownError``, ``jax.errors.JaxRuntimeError``) with ddl's message inside,
and the type is lost: ``ddl.elastic.run`` could not tell a lost worker from a bug. The
callback records the error here (:func:`recording`); :func:`raising_ddl_errors` gives the
caller the recorded error back in place of the framework's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple, Type, Union

from ddl.core.errors import DDLError


class _Last:
    error: Optional[BaseException] = None  # any thread's: callbacks run on the framework's


def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a host callback), remembering the ddl error it raises."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DDLError as exc:
            _Last.error = exc
            raise

    return call


def raising_ddl_errors(func: Callable[..., Any],
                       wrappers: Union[Type[BaseException], Tuple[Type[BaseException], ...]]
                       ) -> Callable[..., Any]:
    """``func``, raising the ddl error a callback recorded during the call where the
    framework raised one of ``wrappers`` that carries it (its message names the error's
    type); any other error passes unchanged."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        _Last.error = None
        try:
            return func(*args, **kwargs)
        except wrappers as exc:
            original, _Last.error = _Last.error, None
            if original is not None and type(original).__name__ in str(exc):
                raise original from exc
            raise

    return call
