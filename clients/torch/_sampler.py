"""``ElasticSampler``: a data sampler that survives a change of workers mid-epoch.

Cross-rank contract. Every rank builds the sampler over the same dataset with the same
``shuffle`` and ``seed``, calls ``set_epoch`` with the same epoch, and trains in lockstep
(one batch per step, the same batch size on every rank). Then, within an epoch, across
any number of changes of the world (rollbacks to the last commit included), every index
of the dataset is processed exactly once over all ranks: none twice, none skipped,
provided the training loop records each finished batch (``record_batch``) before it
commits and restores the committed sampler state after a failure (``TorchState`` does).

How. An epoch's order is a permutation of ``range(len(dataset))`` (seeded by ``seed +
epoch``; the identity without ``shuffle``), the same on every rank. ``reset()`` (at a new
world) drops the processed indices from it: the rest, ``remaining_indices`` (a NumPy
array), is dealt round-robin, rank ``r`` of ``n`` taking ``remaining_indices[r::n]``.
The ``b``-th batch
of size ``B`` of every rank together is therefore the slice ``remaining_indices[b*B*n :
(b+1)*B*n]``: the ``b``-th ``record_batch(_, B)`` since the reset marks that whole slice
processed on every rank, from local arithmetic, without talking to the others, so that
every rank's committed state knows what every rank processed, and losing a rank loses
nothing. As in Horovod, ``record_batch`` counts: each call marks the world's next batch,
whatever its ``batch_idx``.

No padding. When ``len(remaining_indices) % n != 0``, ranks ``0 .. k-1`` (``k`` the
remainder) get one index more than the others (rank 0 is always among the longest):
no index is repeated to even them out (Horovod's ``ElasticSampler`` repeats some). With a
``DataLoader`` the last batch of the shorter ranks is one element smaller, or, when
their share is a multiple of the batch size, they have one batch fewer; end each epoch's
loop with ``ddl.join()`` so that the longer ranks' last step completes without them (its
allreduce averages over the ranks that still have data; a ``commit()`` there is safe,
its broadcast comes from rank 0).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Set

import numpy as np
import torch.utils.data

import ddl


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the ranks of the current world and remembers, within an
    epoch, which indices were processed, so that a new world carries on with the rest
    (see the module doc for the contract and the rule when the ranks' shares differ).

    ``num_replicas`` and ``rank``: the world to shard over; default ``ddl.size()`` and
    ``ddl.rank()``, read again at every ``reset()`` (give both to use the sampler
    without a ddl job, e.g. in a test).

    Example::

        sampler = ddl.elastic.ElasticSampler(dataset, shuffle=True, seed=42)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        state = ddl.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

        @ddl.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                for batch_idx, (x, y) in enumerate(loader):
                    step(x, y)
                    state.sampler.record_batch(batch_idx, 32)
                    if batch_idx % 10 == 9:
                        state.commit()
                ddl.join()                  # ranks' shares may differ by one
                state.sampler.set_epoch(state.epoch + 1)
                state.commit()
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0, *,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None):
        if (num_replicas is None) != (rank is None):
            raise ValueError(f"ElasticSampler: give both num_replicas and rank or neither "
                             f"(got num_replicas={num_replicas}, rank={rank})")
        if num_replicas is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"ElasticSampler: rank must be in [0, num_replicas), got "
                             f"rank={rank}, num_replicas={num_replicas}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._world = None if num_replicas is None else (int(num_replicas), int(rank))
        self.epoch = 0
        # processed in this epoch, one flag per index: a commit copies it in microseconds
        self._processed = np.zeros(len(dataset), dtype=bool)
        # of those, the ones this rank recorded itself (record_indices): rank 0 knows
        # them only through sync()
        self._own = np.zeros(len(dataset), dtype=bool)
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices = np.zeros(0, dtype=np.int64)
        self.indices: List[int] = []
        self._recorded = 0  # of remaining_indices, the leading ones record_batch marked
        self.reset()

    @property
    def processed_indices(self) -> Set[int]:
        """The indices processed in this epoch (as this rank knows them)."""
        return set(np.flatnonzero(self._processed).tolist())

    @property
    def processed_num(self) -> int:
        """How many indices were processed in this epoch (as this rank knows them)."""
        return int(np.count_nonzero(self._processed))

    @property
    def num_samples(self) -> int:
        """This rank's share of what remains: ``len(self)``."""
        return len(self.indices)

    @property
    def total_size(self) -> int:
        """Every rank's share together: ``len(remaining_indices)`` (no padding)."""
        return len(self.remaining_indices)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new order (with shuffle)."""
        self.epoch = int(epoch)
        self._processed[:] = False
        self._own[:] = False
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark the world's next batch of size ``batch_size`` processed: the indices every
        rank took for it (after the last ``reset()``, the ``k``-th call marks every rank's
        ``k``-th batch). Call it once per batch trained, as Horovod's: ``batch_idx`` (the
        loader's index) is checked, not used, so a loop that counts on after a rollback
        still records the right indices."""
        if batch_idx < 0 or batch_size <= 0:
            raise ValueError(f"ElasticSampler.record_batch: batch_idx must be >= 0 and "
                             f"batch_size > 0, got batch_idx={batch_idx}, "
                             f"batch_size={batch_size}")
        start, self._recorded = self._recorded, self._recorded + batch_size * self.num_replicas
        self._processed[self.remaining_indices[start:self._recorded]] = True

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark ``indices`` processed, on this rank only (``sync()`` adds every rank's to
        rank 0's state). Prefer ``record_batch``: indices recorded here by a rank that is
        lost before they reach a ``sync()`` are processed again."""
        got = self._checked(indices, "record_indices")
        self._processed[got] = True
        self._own[got] = True

    def _checked(self, indices: Any, what: str) -> np.ndarray:
        got = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices,
                         dtype=np.int64).reshape(-1)
        bad = got[(got < 0) | (got >= len(self._processed))]
        if bad.size:
            raise ValueError(f"ElasticSampler.{what}: indices {bad[:5].tolist()} are out of "
                             f"range for a dataset of {len(self._processed)}")
        return got

    def state_dict(self) -> Dict[str, Any]:
        """``{"epoch": int, "processed_indices": int64 array, "own_indices": int64
        array}`` (own: those of ``record_indices``; optional in ``load_state_dict``)."""
        return {"epoch": self.epoch, "processed_indices": np.flatnonzero(self._processed),
                "own_indices": np.flatnonzero(self._own)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take ``state_dict`` (from ``state_dict()``, or Horovod's ``{"epoch",
        "processed_num"}``: the first indices of that epoch's order) and ``reset()``."""
        epoch = int(state_dict["epoch"])
        if "processed_indices" not in state_dict and "processed_num" in state_dict:
            state_dict = {"processed_indices":
                          self._order(epoch)[:int(state_dict["processed_num"])]}
        processed = self._checked(state_dict["processed_indices"], "load_state_dict")
        own = self._checked(state_dict.get("own_indices", ()), "load_state_dict")
        self.epoch = epoch   # once the state is known good: a bad one changes nothing
        self._processed = np.zeros(len(self.dataset), dtype=bool)
        self._processed[processed] = True
        self._own = np.zeros(len(self.dataset), dtype=bool)
        self._own[own] = True
        self._processed[own] = True
        self.reset()

    def sync(self) -> None:
        """A collective: every rank takes rank 0's epoch and processed indices, with the
        indices any rank recorded itself in that epoch (``record_indices``), then
        ``reset()``s.

        Rank 0's, not the union of every rank's: after a failure the survivors may have
        rolled back to different commits (one rank saved step ``k`` before the failure
        reached it, another failed at step ``k``'s collectives, before its commit); the
        model and every other value of the state come from rank 0's commit, and so must
        the samples it counts as trained (the union would skip step ``k``'s samples,
        which rank 0's model never learned from and its counters never counted)."""
        epoch, processed = ddl.broadcast_object(
            (self.epoch, np.flatnonzero(self._processed)) if ddl.rank() == 0 else None, 0,
            name="ddl.elastic.ElasticSampler/processed")
        everyone = ddl.allgather_object((self.epoch, np.flatnonzero(self._own)),
                                        name="ddl.elastic.ElasticSampler/own")
        own = np.concatenate([np.zeros(0, np.int64)] +
                             [indices for e, indices in everyone if e == epoch])
        self.load_state_dict({"epoch": epoch, "processed_indices": processed,
                              "own_indices": own})

    def reset(self) -> None:
        """Re-shard the indices not processed yet in this epoch over the current world
        (``ddl.size()``, ``ddl.rank()``, or the explicit ``num_replicas``/``rank``)."""
        self.num_replicas, self.rank = (self._world if self._world is not None
                                        else (ddl.size(), ddl.rank()))
        order = self._order()
        self.remaining_indices = order[~self._processed[order]]
        self._recorded = 0
        self.indices = self.remaining_indices[self.rank::self.num_replicas].tolist()

    def _order(self, epoch: Optional[int] = None) -> np.ndarray:
        """The order of ``epoch`` (default: the current one)."""
        n = len(self._processed)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        epoch = self.epoch if epoch is None else epoch
        return np.random.default_rng(self.seed + epoch).permutation(n).astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)
