"""The checks of :class:`~ddl.launcher.elastic.driver.ElasticJob`'s loop, run after every
event (at least every 0.1 s), and the job's end.

Each check: ranks others saw lost and past their grace are stopped, a world that can
form forms, a released worker that did not exit is stopped. The job succeeds once every
worker is gone after one of the world finished; it fails when a world cannot form within
``--elastic-timeout`` (a worker that never joined has ``--start-timeout`` from its
start), when fewer than ``--min-np`` remain and no host can bring more, at once when no
worker remains (none holds the committed state, so none would be started), or when the
others do not follow a finished worker within :data:`FINISH_GRACE_S`. A failure is sent to every
waiting worker, and the end gives them a moment to take it before all are stopped.
"""

from __future__ import annotations

import queue
import time
from typing import Optional

from ddl.launcher._job import JobResult
from ddl.launcher._spawn import exit_code

FINISH_GRACE_S = 30.0  # after one worker of the world finished: the others' time to exit
RELEASE_GRACE_S = 10.0  # a released worker's time to exit before it is stopped
WAIT_NOTE_S = 2.0  # a world short of --min-np workers this long says what it waits for


class JobChecks:
    """Mixed into ElasticJob (uses its ``_workers``, ``min_np``, ``generation``,
    ``elastic_timeout``, ``start_timeout``, ``blacklist``, ``_round_open_since``,
    ``_released_at``, ``_finished_at``, ``_failure``, ``_last_loss``, ``_waiting_said``,
    ``_events``, ``_handle``, ``_stop_lost``, ``_try_form``, ``_can_grow``, ``_kill``,
    ``_teardown``, ``_reply`` and ``_log``)."""

    def _check(self) -> Optional[JobResult]:
        now = time.monotonic()
        self._stop_lost(now)
        self._try_form()
        for index, since in list(self._released_at.items()):
            w = self._workers[index]
            if w.returncode is not None:
                del self._released_at[index]
            elif now - since > RELEASE_GRACE_S + self.elastic_timeout:
                self._log(f"{w.label()} was released but did not exit; stopping it")
                self._kill(w)
                del self._released_at[index]
        if self._failure:
            return self._end(1, self._failure)
        live_count = sum(1 for w in self._workers.values() if w.live)
        if self._round_open_since is not None and live_count < self.min_np \
                and not self._can_grow(now):
            self._fail(f"fewer than --min-np {self.min_np} workers remain ({live_count}) and "
                       f"no host can bring more (no --host-discovery-script, and the hosts "
                       f"blacklisted for the rest of the job: "
                       f"{', '.join(self.blacklist.hosts(now)) or 'none'}); the last "
                       f"loss: {self._last_loss}")
            return self._end(1, self._failure)
        if self._round_open_since is not None and live_count == 0 and self._workers:
            # as horovodrun, whose job stops once all its workers failed: no worker
            # holds the committed state, so none is started and no world can form
            self._fail(f"every worker has exited, so none holds the committed state and "
                       f"no world can form; the last loss: {self._last_loss}")
            return self._end(1, self._failure)
        if (self._round_open_since is not None and live_count < self.min_np
                and self._waiting_said != self.generation
                and now - self._round_open_since > WAIT_NOTE_S):
            self._waiting_said = self.generation   # say it once, not only with --verbose
            self._log(f"world {self.generation + 1} waits: {live_count} worker(s) remain, "
                      f"fewer than --min-np {self.min_np}; waiting up to "
                      f"{self.elastic_timeout:g} s (--elastic-timeout) for hosts to bring "
                      f"more (blacklisted: {', '.join(self.blacklist.hosts(now)) or 'none'}); "
                      f"the last loss: {self._last_loss}")
        if self._round_open_since is not None and now - self._round_open_since \
                > self.elastic_timeout and not self._starting_in_time(now):
            live = [w for w in self._workers.values() if w.live]
            missing = [w.label() + (" (never joined: --start-timeout "
                                    f"{self.start_timeout:g} s)" if w.state == "starting"
                                    else "") for w in live if w.join is None]
            if missing:
                why = (f"the workers could not form world {self.generation + 1} within "
                       f"--elastic-timeout {self.elastic_timeout:g} s: waited for "
                       f"{', '.join(missing)}")
            else:
                why = (f"fewer than --min-np {self.min_np} workers remain ({len(live)}) and "
                       f"no host brought more within --elastic-timeout "
                       f"{self.elastic_timeout:g} s (blacklisted: "
                       f"{', '.join(self.blacklist.hosts(now)) or 'none'})")
            self._fail(why)
            return self._end(1, self._failure)
        if all(not w.live for w in self._workers.values()) and self._workers:
            if self._finished_at is not None:
                return JobResult(0, {w.index: exit_code(w.returncode or 0) for w in
                                     self._workers.values()})
            if self._round_open_since is None:
                self._fail("every worker is gone")
        if self._finished_at is not None and now - self._finished_at > FINISH_GRACE_S:
            left = [w.label() for w in self._workers.values() if w.live]
            self._fail(f"a worker finished but {', '.join(left)} did not within "
                       f"{FINISH_GRACE_S:g} s")
        return None

    def _starting_in_time(self, now: float) -> bool:
        """Whether a worker that never joined is still within --start-timeout of its
        start: starting Python and the framework (over ssh, too) is bounded by that, as
        in a fixed job, not by --elastic-timeout, the bound of a change (horovodrun's
        elastic timeout bounds the wait for hosts, not a worker's start)."""
        return any(w.state == "starting" and now - w.started_at <= self.start_timeout
                   for w in self._workers.values())

    def _fail(self, why: str) -> None:
        if self._failure:
            return
        self._failure = why
        for w in self._workers.values():
            if w.live and w.join is not None:
                self._reply(w, self._error_reply())

    def _error_reply(self) -> dict:
        live = sum(1 for w in self._workers.values() if w.live)
        return {"op": "error", "message": self._failure, "min_np": self.min_np,
                "available": live}

    def _end(self, code: int, why: str) -> JobResult:
        deadline = time.monotonic() + 5.0  # the workers join, get the error, and exit
        while time.monotonic() < deadline and any(w.returncode is None for w in
                                                  self._workers.values()):
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._handle(event)  # joins get the error; exits are recorded
        self._teardown()
        return JobResult(code, {w.index: exit_code(w.returncode) if w.returncode is not None
                                else -1 for w in self._workers.values()}, summary=why)
