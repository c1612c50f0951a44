"""Where a Spark estimator keeps its data and its runs (Horovod's
``horovod.spark.common.store``): a directory that the driver and every executor see at
the same path.

Under ``prefix_path``:

- ``intermediate_train_data[.IDX]`` and ``intermediate_val_data[.IDX]``: the Parquet
  datasets :meth:`ddl.spark.torch.TorchEstimator.fit` writes from the DataFrame (its
  feature, label and weight columns), which each rank reads its shard of;
- ``runs/RUN_ID/``: one training run's checkpoint (rewritten at every epoch by rank 0)
  and ``logs/``.

:meth:`Store.create` makes a :class:`LocalStore` for a local path or a ``file://`` URL.
On a cluster that path must be on a filesystem every node mounts (NFS, a FUSE mount of
HDFS or an object store). HDFS and DBFS URLs are refused with what to use instead.
"""

from __future__ import annotations

import abc
import os
import shutil
from typing import List, Optional

__all__ = ["Store", "LocalStore", "FilesystemStore"]


class Store(abc.ABC):
    """The interface of a store (see the module doc); :meth:`create` picks one."""

    @staticmethod
    def create(prefix_path: str, *args, **kwargs) -> "Store":
        """The store for ``prefix_path``: a :class:`LocalStore` for a local path or a
        ``file://`` URL; ValueError for another scheme, naming it."""
        scheme = prefix_path.split("://", 1)[0].lower() if "://" in prefix_path else ""
        if scheme in ("", "file"):
            return LocalStore(prefix_path, *args, **kwargs)
        raise ValueError(
            f"Store.create({prefix_path!r}): ddl's estimators read and write the store "
            f"as a local filesystem, and {scheme}:// is not one; mount it where every node "
            f"sees it (an NFS export, hdfs-fuse, s3fs, /dbfs on Databricks) and pass that "
            f"path")

    # what the estimators use: a store of another kind implements these
    @abc.abstractmethod
    def get_train_data_path(self, idx: Optional[int] = None) -> str:
        """Where the training data of dataset ``idx`` (None: the default) is written."""

    @abc.abstractmethod
    def get_val_data_path(self, idx: Optional[int] = None) -> str:
        """Where the validation data of dataset ``idx`` is written."""

    @abc.abstractmethod
    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        """The checkpoint file of run ``run_id``; None when runs are not saved."""

    @abc.abstractmethod
    def parquet_files(self, path: str) -> List[str]:
        """The Parquet files of the dataset at ``path``, in name order ([]: none)."""

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """The bytes of the file at ``path``."""

    @abc.abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` whole (readers see the old file or the new)."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove the dataset or file at ``path``, if there is one."""


class FilesystemStore(Store):
    """A store in a directory tree (Horovod's ``AbstractFilesystemStore``): the data
    and runs paths default to ``intermediate_train_data``, ``intermediate_val_data``,
    ``intermediate_test_data`` and ``runs`` under ``prefix_path``; with ``save_runs``
    False no checkpoint or log is kept."""

    CHECKPOINT_FILENAME = "checkpoint"
    LOGS_SUBDIR = "logs"

    def __init__(self, prefix_path: str, train_path: Optional[str] = None,
                 val_path: Optional[str] = None, test_path: Optional[str] = None,
                 runs_path: Optional[str] = None, save_runs: bool = True):
        self.prefix_path = self._local(prefix_path)
        self._train_path = self._local(train_path) if train_path else \
            os.path.join(self.prefix_path, "intermediate_train_data")
        self._val_path = self._local(val_path) if val_path else \
            os.path.join(self.prefix_path, "intermediate_val_data")
        self._test_path = self._local(test_path) if test_path else \
            os.path.join(self.prefix_path, "intermediate_test_data")
        self._runs_path = self._local(runs_path) if runs_path else \
            os.path.join(self.prefix_path, "runs")
        self._save_runs = save_runs

    @staticmethod
    def _local(path: str) -> str:
        return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)

    @staticmethod
    def _indexed(path: str, idx: Optional[int]) -> str:
        return path if idx is None else f"{path}.{idx}"

    def get_train_data_path(self, idx: Optional[int] = None) -> str:
        return self._indexed(self._train_path, idx)

    def get_val_data_path(self, idx: Optional[int] = None) -> str:
        return self._indexed(self._val_path, idx)

    def get_test_data_path(self, idx: Optional[int] = None) -> str:
        return self._indexed(self._test_path, idx)

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self._runs_path, run_id)

    def get_checkpoint_filename(self) -> str:
        return self.CHECKPOINT_FILENAME

    def get_logs_subdir(self) -> str:
        return self.LOGS_SUBDIR

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        return (os.path.join(self.get_run_path(run_id), self.get_checkpoint_filename())
                if self._save_runs else None)

    def get_logs_path(self, run_id: str) -> Optional[str]:
        return (os.path.join(self.get_run_path(run_id), self.get_logs_subdir())
                if self._save_runs else None)

    def saving_runs(self) -> bool:
        return self._save_runs

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.partial-{os.getpid()}"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)

    def is_parquet_dataset(self, path: str) -> bool:
        return bool(self.parquet_files(path))

    def parquet_files(self, path: str) -> List[str]:
        if not os.path.isdir(path):
            return []
        return sorted(os.path.join(path, name) for name in os.listdir(path)
                      if name.endswith(".parquet") and not name.startswith((".", "_")))

    def remove(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)


class LocalStore(FilesystemStore):
    """A :class:`FilesystemStore` on this machine's filesystem (Horovod's LocalStore):
    a local Spark's, or a shared mount's on a cluster."""
