"""The worlds of :class:`~ddl.launcher.elastic.driver.ElasticJob`: joins, the end of a
world, the forming of the next, and the gathers within one.

A world ends (a *round* opens) when a member leaves it and joins again, is gone, or is
released. A member that joins names the ranks it saw lost; each that had not joined then
gets :data:`LOST_GRACE_S` to exit on its own (and say how it ended) before it is killed as
lost, joined meanwhile or not; no world forms until then. The next world forms once every
live worker joined and there are at least ``--min-np``: survivors keep their order (the
host of the lowest old rank first), new workers follow, and each gets an ``assign`` with
its rank, the world's size and its job id (:func:`generation_job_id`). An ``allgather`` is
answered once every member of the world sent its value; a world that ends fails the
gathers still open.
"""

from __future__ import annotations

import hashlib
import time
from typing import Dict

from ddl.launcher.elastic.workers import _Worker

# a rank another saw lost gets this long to exit on its own (one leaving after an
# exception says how it ended: "exited with code 1") before it is killed as lost
LOST_GRACE_S = 2.0


def generation_job_id(job_id: str, generation: int) -> str:
    return hashlib.sha256(f"{job_id}/{generation}".encode()).hexdigest()[:16]


class Worlds:
    """Mixed into ElasticJob (uses its ``_workers``, ``members``, ``generation``,
    ``history``, ``job_id``, ``min_np``, ``max_np``, ``reset_limit``, ``_host_order``,
    ``_round_open_since``, ``_gathers``, ``_lost_at``, ``_released_at``, ``_version``,
    ``_addresses``, ``_finished_at``, ``_failure``, ``_fill``, ``_kill``, ``_gone``,
    ``_fail``, ``_error_reply``, ``_reply`` and ``_log``)."""

    def _on_join(self, w: _Worker, message: dict) -> None:
        if w.state in ("released", "finished") or self._finished_at is not None:
            if w.live:  # a worker started just before the job finished: its exit is no loss
                w.state = "released"
                self._released_at[w.index] = time.monotonic()
            self._reply(w, {"op": "exit", "message": "the job finished" if
                            self._finished_at is not None else "ddlrun released it"})
            return
        if self._failure:
            self._reply(w, self._error_reply())
            return
        w.join = message
        if w.generation == self.generation and w.generation >= 0 and w.index in self.members:
            self._open_round(f"{w.label()} left world {self.generation}: "
                             f"{str(message.get('reason', ''))[:200]}")
            for rank in message.get("lost", []):
                self._drop_rank(int(rank), f"worker {w.index} saw rank {rank} lost")
        w.state = "running"

    def _drop_rank(self, rank: int, why: str) -> None:
        """A rank of the current world that another saw lost, and that had not joined
        then: kill it if it still runs the grace later (a frozen process, a host cut off;
        also when it joined meanwhile, as when two ranks each saw the other lost: a link
        between them is broken, and one must go for the next world to work), and stop
        waiting for it. No world forms meanwhile."""
        if not 0 <= rank < len(self.members):
            return
        lost = self._workers[self.members[rank]]
        if lost.live and lost.join is None:   # stopped in _check unless it exits first
            self._lost_at.setdefault(lost.index, (time.monotonic(), rank, why))

    def _lost_grace(self) -> float:
        """How long a rank reported lost has to exit on its own: ``LOST_GRACE_S``, or half
        the ``--elastic-timeout`` when that is shorter (the world must form within it)."""
        return min(LOST_GRACE_S, self.elastic_timeout / 2)

    def _stop_lost(self, now: float) -> None:
        """Kill the ranks others saw lost that have not exited within the grace."""
        for index, (since, rank, why) in list(self._lost_at.items()):
            lost = self._workers[index]
            if lost.returncode is not None or lost.state in ("gone", "finished"):
                del self._lost_at[index]   # it exited: its exit says how
            elif now - since > self._lost_grace():
                del self._lost_at[index]
                self._log(f"{lost.label()} (rank {rank} of world {self.generation}) was "
                          f"lost ({why}); stopping it")
                self._kill(lost)
                if lost.live:   # (a released one is stopped, not counted)
                    self._gone(lost, f"lost: {why}")

    def _open_round(self, why: str) -> None:
        if self._round_open_since is None:
            self._round_open_since = time.monotonic()
            self._log(f"world {self.generation} ends: {why}")
            self._fail_gathers(f"world {self.generation} ended: {why}")

    def _try_form(self) -> None:
        if self._round_open_since is None or self._failure or self._finished_at is not None \
                or self._lost_at:   # a rank reported lost may yet be stopped
            return
        if self.generation >= 0 and any(self._workers[i].live and self._workers[i].join
                                        is not None for i in self.members):
            # a world ended and a worker of it, with the committed state, joined the next:
            # free slots of allowed hosts get workers for that one (world 0 has its -np)
            self._fill(self.max_np)
        live = [w for w in self._workers.values() if w.live]
        if not live or any(w.join is None for w in live) or len(live) < self.min_np:
            return
        if self.reset_limit is not None and len(self.history) > self.reset_limit:
            self._fail(f"the workers changed {len(self.history)} times, more than "
                       f"--reset-limit {self.reset_limit}")
            return
        old_rank = {i: r for r, i in enumerate(self.members)}
        big = len(self._workers) + 1
        host_key: Dict[str, float] = {}
        for w in live:
            key = old_rank.get(w.index, big + self._host_rank(w.host))
            host_key[w.host] = min(host_key.get(w.host, key), key)
        ordered = sorted(live, key=lambda w: (host_key[w.host], old_rank.get(w.index, big),
                                              w.index))
        self.generation += 1
        self.members = [w.index for w in ordered]
        self.history.append(len(ordered))
        job_id = generation_job_id(self.job_id, self.generation)
        took = time.monotonic() - self._round_open_since
        self._round_open_since = None
        self._gathers = {}
        self._log(f"world {self.generation}: {len(ordered)} workers "
                  f"({', '.join(f'{w.index}@{w.host}' for w in ordered)}), formed in "
                  f"{took:.2f} s")
        for rank, w in enumerate(ordered):
            w.generation, w.rank, w.join = self.generation, rank, None
            self._reply(w, {"op": "assign", "generation": self.generation, "rank": rank,
                            "size": len(ordered), "job_id": job_id,
                            "version": self._version, "bind": self._addresses.get(w.host, "")})

    def _host_rank(self, host: str) -> int:
        return self._host_order.index(host) if host in self._host_order else len(
            self._host_order)

    def _on_allgather(self, w: _Worker, message: dict) -> None:
        generation = int(message.get("generation", -1))
        if generation != self.generation or self._round_open_since is not None \
                or w.index not in self.members:
            self._reply(w, {"op": "error", "message": f"world {generation} is over"})
            return
        seq = int(message.get("seq", 0))
        got = self._gathers.setdefault(seq, {})
        got[w.rank] = message.get("value")
        if len(got) == len(self.members):
            values = [got[r] for r in range(len(self.members))]
            del self._gathers[seq]
            for index in self.members:
                self._reply(self._workers[index], {"op": "values", "values": values})

    def _fail_gathers(self, why: str) -> None:
        for got in self._gathers.values():
            for rank in got:
                self._reply(self._workers[self.members[rank]], {"op": "error", "message": why})
        self._gathers.clear()
