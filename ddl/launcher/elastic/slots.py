"""Which hosts and slots :class:`~ddl.launcher.elastic.driver.ElasticJob` runs workers
on: discovery's list as it changes, the blacklist, and workers started on free slots.

A thread asks discovery every :data:`DISCOVERY_INTERVAL_S` (when a script is polled, or a
blacklisted host may come back) and puts ``hosts`` on the job's queue. A host that leaves
the list has its workers released (a member's release ends its world); new hosts, more
slots and hosts back from the blacklist get workers up to ``--max-np``. Each change
raises the *membership version* that rank 0 asks for at every ``State.commit()``.
"""

from __future__ import annotations

import time
from typing import Dict

DISCOVERY_INTERVAL_S = 1.0


class HostSlots:
    """Mixed into ElasticJob (uses its ``discovery``, ``blacklist``, ``np``, ``max_np``,
    ``_hosts``, ``_host_order``, ``_blacklisted``, ``_workers``, ``_released_at``,
    ``members``, ``_version``, ``_version_kinds``, ``_finished_at``, ``_failure``,
    ``_closing``, ``_events``, ``_probe``, ``_start_worker``, ``_open_round``, ``_reply``
    and ``_log``)."""

    def _update_hosts(self, hosts: Dict[str, int], initial: bool = False) -> None:
        now = time.monotonic()
        out = set(self.blacklist.hosts(now))
        back, self._blacklisted = self._blacklisted - out, out
        if hosts == self._hosts and not initial and not back:
            return
        for host in hosts:
            if host not in self._host_order:
                self._host_order.append(host)
        gone_hosts = [h for h in self._hosts if h not in hosts]
        self._hosts = dict(hosts)
        removed = 0
        for w in self._workers.values():
            if w.live and w.host in gone_hosts:
                w.state = "released"
                self._released_at[w.index] = time.monotonic()
                removed += 1
                if w.join is not None:
                    self._reply(w, {"op": "exit", "message": f"host {w.host} left the job"})
        if removed:
            self._log(f"host(s) {', '.join(gone_hosts)} left: {removed} worker(s) released")
            self._bump("removed")
            if any(self._workers[i].state == "released" for i in self.members):
                self._open_round(f"host(s) {', '.join(gone_hosts)} left")
        added = self._fill(self.np if initial else self.max_np)
        if added and not initial:
            self._bump("added")

    def _bump(self, kind: str) -> None:
        self._version += 1
        self._version_kinds.append(kind)

    def _fill(self, target: int) -> int:
        """Start workers on free slots of allowed hosts, up to ``target`` live ones."""
        if self._finished_at is not None or self._failure:
            return 0
        now = time.monotonic()
        live = [w for w in self._workers.values() if w.live]
        started = 0
        for host, slots in self._hosts.items():
            if not self.blacklist.allowed(host, now):
                continue
            used = {w.slot for w in live if w.host == host}
            for slot in range(slots):
                if len(live) + started >= target:
                    return started
                if slot not in used:
                    self._start_worker(host, slot)
                    started += 1
        return started

    def _can_grow(self, now: float) -> bool:
        """Whether more workers may still come: a discovery script, a blacklist that
        ends, or a free slot on an allowed host."""
        if self.discovery.polled or self.blacklist.cooldown is not None:
            return True
        used = {(w.host, w.slot) for w in self._workers.values() if w.live}
        return any(self.blacklist.allowed(h, now) and (h, s) not in used
                   for h, n in self._hosts.items() for s in range(n))

    def _discover(self) -> None:
        problem = ""
        while not self._closing.wait(DISCOVERY_INTERVAL_S):
            if not self.discovery.polled and self.blacklist.cooldown is None:
                continue
            hosts = self.discovery.find()
            if self.discovery.problem and self.discovery.problem != problem:
                self._log(f"warning: {self.discovery.problem}")
            problem = self.discovery.problem
            hosts, chosen = self._probe(hosts)
            if chosen:
                self._events.put(("addresses", chosen))
            self._events.put(("hosts", hosts))
