"""The stable surface for framework integrations (``clients/*``: ``ddl.torch`` and friends).

A framework client imports from :mod:`ddl` (the public API) and from this module, and
from no other private ``ddl`` module (tests/test_client_imports.py checks it). What is
here is what a client needs beyond the public API, kept stable for them:

- :func:`client_reduce_op`: the one rule for Horovod's ``op=`` / older ``average=``
  arguments (Average when neither is given), shared by every client.
- :class:`Compressor`, :class:`CastCompressor` and :func:`compressions`: the one
  ``Compression`` implementation; a client passes its cast and builds its namespace.
- :data:`BFLOAT16`: the NumPy dtype the data plane uses for bfloat16 (``ml_dtypes``).
- :mod:`device_arrays <ddl.runtime.device_arrays>`: device views of a framework's CUDA
  arrays and their results, for an adapter's ``to_device`` and ``from_device``.
- :func:`refuse`: a call the client cannot make (it was not given its framework's
  tensor) fails on every member at once, not on this rank alone.
- :func:`process_set_by_id`: the :class:`~ddl.ProcessSet` this rank knows by Horovod's
  integer id (the TensorFlow ops take ids).
- :func:`check_rows_agree`: the same :class:`~ddl.MismatchError` on every member for
  what each gathered from all (a sparse tensor's dense shape).
- :func:`recording` and :func:`raising_ddl_errors`: ddl's typed errors through a compiled
  program (a collective run as a host callback), for the clients' ``elastic.run``.
- :mod:`engine_ranks <ddl.launcher.engine_ranks>`: for cluster engines (``ddl.spark``,
  ``ddl.ray``): start one rank in a fresh process, and name the failure that came first.
- :mod:`elastic_driver <ddl.launcher.elastic.driver>` and :mod:`elastic_discovery
  <ddl.launcher.elastic.discovery>`: the elastic driver (``ElasticJob``), for engines
  that start its workers their own way (``ddl.ray.ElasticRayExecutor``).
"""

from __future__ import annotations

from ddl._agree import check_rows_agree
from ddl._api import refuse
from ddl._callback_errors import raising_ddl_errors, recording
from ddl._compression import CastCompressor, Compressor, compressions
from ddl._process_sets import by_id as process_set_by_id
from ddl.core.dtypes import BFLOAT16, client_reduce_op
from ddl.launcher import engine_ranks
from ddl.runtime import device_arrays
from ddl.launcher.elastic import discovery as elastic_discovery
from ddl.launcher.elastic import driver as elastic_driver

__all__ = ["check_rows_agree", "refuse", "process_set_by_id", "client_reduce_op",
           "Compressor", "CastCompressor", "compressions", "BFLOAT16", "engine_ranks",
           "device_arrays", "recording", "raising_ddl_errors", "elastic_discovery",
           "elastic_driver"]
