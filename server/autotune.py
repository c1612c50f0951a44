"""Autotuning (``ddlrun --autotune``): the leader's choice of knob settings, made online.

One :class:`Tuner` lives in the leader's coordinator, which sees every response of the
job. The :class:`~ddl.server.leader.Leader` (pure logic) asks it for the current
:class:`TuningSetting` before each flush, fuses with its fusion threshold and stamps it on
every response it sends; each rank applies a stamped setting before it executes that
response (:mod:`ddl.runtime.execute`), so every member of a collective runs it with the
same values and a change takes effect at one point of the global order. The leader then
hands the flushed responses to :meth:`Tuner.observe`.

**Samples.** A sample is one setting held for ``steps_per_sample`` steps of the training
loop. The leader sees a step end when a name comes round again (a name that already
completed in the current step completes again: every rank finished the previous step and
started the next), or after ``MAX_STEP_NAMES`` names (a loop whose names never repeat).
The sample starts at the first step begun after the setting was sent, and its score is
the bytes of the data responses of its steps over the time they took. The first
``warmup_samples`` samples run the configured setting and are discarded; then optuna's
TPE sampler (Bayesian optimisation, a maintained library rather than our own) proposes
``max_samples`` settings, the configured one first, and the best scoring one is kept
for the rest of the job. Every sample is a row of the CSV log (``log_file``).

**Knobs.** The fusion threshold always; the shared-memory allreduce algorithm when ranks
share a host; the TCP crossover (``DDL_SMALL_MESSAGE_BYTES``) and chunk size when bytes
cross TCP; hierarchical allreduce when the job spans hosts. Sizes are searched on a log2
scale. The shared-memory spin budget is not a knob: the engine's thread never spins.

optuna is imported here only (``pip install 'ddl-train[autotune]'``); ``import ddl`` does not.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ddl.core.config import var
from ddl.core.dtypes import from_wire
from ddl.core.errors import ConfigError
from ddl.v1 import coordinator_pb2 as pb

log = logging.getLogger("ddl.server")

MAX_STEP_NAMES = 4096  # names in a step after which the tuner counts a step anyway
EXTRA_HINT = "pip install 'ddl-train[autotune]' (or pip install optuna)"
_DATA_OPS = frozenset((pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL,
                       pb.REDUCESCATTER))
LOG_COLUMNS = ("sample", "phase", "setting_id", "fusion_threshold", "small_message_bytes",
               "tcp_chunk_bytes", "hierarchical_allreduce", "shm_allreduce_algorithm",
               "steps", "bytes", "seconds", "score_bytes_per_s")
# config key -> TuningSetting field
_FIELDS = {"fusion_threshold": "fusion_threshold_bytes",
           "small_message_bytes": "small_message_bytes", "tcp_chunk_bytes": "tcp_chunk_bytes",
           "hierarchical_allreduce": "hierarchical_allreduce",
           "shm_allreduce_algorithm": "shm_allreduce_algorithm"}


@dataclass(frozen=True)
class Knob:
    """One tuned configuration key: a power of two in ``2**low .. 2**high`` bytes, or one
    of ``choices``."""

    key: str
    low: int = 0
    high: int = 0
    choices: Tuple[str, ...] = ()

    def suggest(self, trial) -> Any:
        if self.choices:
            return trial.suggest_categorical(self.key, list(self.choices))
        return 1 << trial.suggest_int(self.key + "_log2", self.low, self.high)

    def param(self, value: Any) -> Tuple[str, Any]:
        """The optuna parameter (name, value) nearest the configured ``value``."""
        if self.choices:
            return self.key, value if value in self.choices else self.choices[0]
        exp = round(math.log2(value)) if value > 0 else self.low
        return self.key + "_log2", min(self.high, max(self.low, exp))


FUSION = Knob("fusion_threshold", 12, 27)
SHM_ALGORITHM = Knob("shm_allreduce_algorithm", choices=var("shm_allreduce_algorithm").choices)
SMALL_MESSAGE = Knob("small_message_bytes", 10, 22)
TCP_CHUNK = Knob("tcp_chunk_bytes", 14, 24)
HIERARCHICAL = Knob("hierarchical_allreduce", choices=("auto", "on", "off"))


def knobs_for(multi_host: bool, transport: str) -> Tuple[Knob, ...]:
    """The knobs that matter for a job: over hosts or not, with ``DDL_TRANSPORT``."""
    out = [FUSION]
    if transport != "tcp":
        out.append(SHM_ALGORITHM)
    if multi_host or transport == "tcp":
        out += [SMALL_MESSAGE, TCP_CHUNK]
    if multi_host:
        out.append(HIERARCHICAL)
    return tuple(out)


class Tuner:
    """Chooses the knob setting of one job, sample after sample (see the module doc).

    ``defaults``: the configured value of every key of :data:`~ddl.core.config.TUNABLE`.
    Not thread-safe: the leader's lock covers every call.
    """

    def __init__(self, defaults: Mapping[str, Any], knobs: Sequence[Knob] = (FUSION,), *,
                 warmup_samples: int = 3, steps_per_sample: int = 10, max_samples: int = 20,
                 log_file: str = "", seed: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        try:
            import optuna
        except ImportError:
            raise ConfigError(f"DDL_AUTOTUNE=1 (ddlrun --autotune) needs optuna, which is not "
                              f"installed: {EXTRA_HINT}", variable="DDL_AUTOTUNE",
                              value="1") from None
        if steps_per_sample < 1 or max_samples < 1 or warmup_samples < 0:
            raise ValueError(f"Tuner: steps_per_sample ({steps_per_sample}) and max_samples "
                             f"({max_samples}) must be >= 1, warmup_samples "
                             f"({warmup_samples}) >= 0")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._defaults = {k: defaults[k] for k in _FIELDS}
        self._knobs = tuple(knobs)
        self.warmup_samples = warmup_samples
        self.steps_per_sample = steps_per_sample
        self.max_samples = max_samples
        self._clock = clock
        self._study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        # the configured setting is the first trial: the tuned one must beat it
        self._study.enqueue_trial(dict(k.param(self._defaults[k.key]) for k in self._knobs))
        self._trial = None
        self._samples = 0  # samples ended, warm-up included
        self._values: Dict[str, Any] = dict(self._defaults)
        self._setting = self._make_setting(1)
        self.done = False
        self.best: Optional[Dict[str, Any]] = None  # the kept values, once done
        self._log = open(log_file, "w", newline="") if log_file else None
        self._csv = csv.writer(self._log) if self._log else None
        if self._csv:
            self._csv.writerow(LOG_COLUMNS)
            self._log.flush()
        self._seen: set = set()  # (process set, name) completed in the current step
        self._reset()
        if warmup_samples == 0:
            self._next()

    # -- for the leader --------------------------------------------------------------
    def setting(self) -> pb.TuningSetting:
        """The setting to stamp on the responses of the next flush."""
        return self._setting

    def observe(self, responses: Sequence[pb.Response]) -> None:
        """The responses one flush sent (stamped with :meth:`setting`). Never raises: a
        failure (optuna's, the log's) ends tuning with the configured setting."""
        if self.done:
            return
        try:
            self._observe(responses)
        except Exception:  # the job goes on untuned rather than fail for its tuner
            log.exception("autotune failed; keeping the configured setting")
            self._values = dict(self._defaults)
            self.best = dict(self._values)
            self._setting = self._make_setting(self._setting.id + 1)
            self.done = True
            self.close()

    def _observe(self, responses: Sequence[pb.Response]) -> None:
        now = None
        for r in responses:
            if r.op not in _DATA_OPS or r.HasField("error"):
                continue
            size = from_wire(r.dtype).itemsize if r.dtype else 1
            for t in r.tensors:
                key = (r.process_set_id, t.name)
                if key in self._seen or len(self._seen) >= MAX_STEP_NAMES:
                    self._seen.clear()  # the loop came round: a step ended
                    now = self._clock() if now is None else now
                    self._step_ended(now)
                self._seen.add(key)
                self._bytes += math.prod(t.shape) * size

    def _step_ended(self, now: float) -> None:
        """Count a step of the sample (the bytes of later responses go to the next)."""
        if self.done:
            return
        if self._start is None:  # the first step run wholly with this setting begins
            self._start, self._steps, self._bytes = now, 0, 0
            return
        self._steps += 1
        if self._steps >= self.steps_per_sample:
            seconds = max(now - self._start, 1e-9)
            self._end_sample(seconds, self._bytes / seconds)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
        self._log = self._csv = None

    # -- samples ---------------------------------------------------------------------
    def _reset(self) -> None:
        self._start: Optional[float] = None
        self._steps = self._bytes = 0

    def _end_sample(self, seconds: float, score: float) -> None:
        warmup = self._samples < self.warmup_samples
        self._samples += 1
        if self._csv:
            v = self._values
            self._csv.writerow((self._samples, "warmup" if warmup else "trial",
                                self._setting.id, v["fusion_threshold"],
                                v["small_message_bytes"], v["tcp_chunk_bytes"],
                                v["hierarchical_allreduce"], v["shm_allreduce_algorithm"],
                                self._steps, self._bytes, f"{seconds:.6f}", f"{score:.1f}"))
            self._log.flush()
        if self._trial is not None:
            self._study.tell(self._trial, score)
            self._trial = None
        self._reset()
        if self._samples - self.warmup_samples >= self.max_samples:
            return self._finish()
        if self._samples >= self.warmup_samples:
            self._next()
        else:
            self._setting = self._make_setting(self._setting.id + 1)

    def _next(self) -> None:
        """Ask optuna for the next setting to try."""
        self._trial = self._study.ask()
        self._values = dict(self._defaults)
        for knob in self._knobs:
            self._values[knob.key] = knob.suggest(self._trial)
        if self._trial.number == 0:  # the enqueued configured setting, exactly
            self._values = dict(self._defaults)
        self._setting = self._make_setting(self._setting.id + 1)

    def _finish(self) -> None:
        trial = self._study.best_trial
        self._values = dict(self._defaults)
        if trial.number != 0:
            for knob in self._knobs:
                name = knob.key if knob.choices else knob.key + "_log2"
                value = trial.params[name]
                self._values[knob.key] = value if knob.choices else 1 << value
        self.best = dict(self._values)
        self._setting = self._make_setting(self._setting.id + 1)
        self.done = True
        log.info("autotune: kept %s (%.3g bytes/s, sample %d of %d); the response cache "
                 "starts now", self.best, trial.value, trial.number + 1, self.max_samples)
        self.close()

    def _make_setting(self, setting_id: int) -> pb.TuningSetting:
        s = pb.TuningSetting(id=setting_id)
        for key, field in _FIELDS.items():
            setattr(s, field, self._values[key])
        return s

    def trials(self) -> List[Tuple[Dict[str, Any], Optional[float]]]:
        """(optuna params, score) of every trial so far (for tests and logs)."""
        return [(t.params, t.value) for t in self._study.trials]
