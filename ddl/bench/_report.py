"""ddl-bench's rows and rank 0's output: a row's fields, the table streamed row by row,
CSV and JSON."""

from __future__ import annotations

import argparse
import csv
import io
import json
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from ddl.bench._cases import REDUCING_OPS, Case, busbw_factor
from ddl.bench._floor import FLOOR_MIN_BYTES
from ddl.bench._peers import PEERS
from ddl.bench._timing import (LARGE_ITERS, LARGE_WARMUP, SMALL_CASE_BYTES, SMALL_ITERS,
                               SMALL_WARMUP, Timing)


def _check(timing: Timing) -> str:
    return "ok" if timing.wrong == 0 else "WRONG"


def make_row(case: Case, ddl_timing: Timing, peers: Dict[str, Optional[Timing]],
             floor: Optional[Tuple[str, Optional[Timing]]] = None) -> Dict[str, Any]:
    """One output row: ddl's fields, then for each implementation of ``peers`` (name ->
    its timing, None where it can't run the dtype) its PEER_* fields, then with ``floor``
    (its kind, and its timing or None where it could not be measured) the floor_*
    fields."""
    factor = busbw_factor(case.op, case.n)
    algbw = case.nbytes / ddl_timing.median_s / 1e9
    row: Dict[str, Any] = {
        "op": case.op, "size": case.nbytes, "count": case.count, "dtype": case.dtype_name,
        "redop": case.reduce_op if case.op in REDUCING_OPS else None, "ranks": case.n, "time_us": ddl_timing.median_s * 1e6,
        "min_us": ddl_timing.min_s * 1e6, "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor, "check": _check(ddl_timing),
    }
    for name, g in peers.items():
        peer_algbw = case.nbytes / g.median_s / 1e9 if g else None
        row.update({
            f"{name}_time_us": g.median_s * 1e6 if g else None,
            f"{name}_min_us": g.min_s * 1e6 if g else None,
            f"{name}_algbw_gbps": peer_algbw,
            f"{name}_busbw_gbps": peer_algbw * factor if g else None,
            f"{name}_check": _check(g) if g else "n/a",
            f"{name}_ratio": g.median_s / ddl_timing.median_s if g else None,
        })
    if floor is not None:
        kind, f = floor
        row.update({"floor_kind": kind if f else None,
                    "floor_us": f.median_s * 1e6 if f else None,
                    "floor_ratio": ddl_timing.median_s / f.median_s if f else None})
    return row


def is_wrong(row: Dict[str, Any]) -> bool:
    """Whether any implementation returned a wrong result in ``row``."""
    return any(row.get(field) == "WRONG"
               for field in ["check"] + [f"{name}_check" for name in PEERS])


_TABLE_COLUMNS = [  # (header, field, alignment and width, format)
    ("op", "op", "<13", "s"), ("size(B)", "size", ">12", "d"),
    ("count", "count", ">11", "d"), ("dtype", "dtype", ">8", "s"),
    ("time(us)", "time_us", ">10", ".1f"), ("algbw(GB/s)", "algbw_gbps", ">11", ".3f"),
    ("busbw(GB/s)", "busbw_gbps", ">11", ".3f"), ("check", "check", ">5", "s"),
]
_FLOOR_COLUMNS = [("floor", "floor_kind", ">8", "s"), ("floor(us)", "floor_us", ">10", ".1f"),
                  ("ddl/floor", "floor_ratio", ">9", ".2f")]


def _peer_columns(name: str) -> List[Tuple[str, str, str, str]]:
    """The table columns of one --compare implementation."""
    return [(f"{name}(us)", f"{name}_time_us", ">10", ".1f"),
            (f"{name}_check", f"{name}_check", ">10", "s"),
            (f"{name}/ddl", f"{name}_ratio", ">8", ".2f")]


def _cell(value: Any, width: str, fmt: str) -> str:
    """One table cell; a missing value (a peer can't run this dtype) reads ``n/a``."""
    if value is None:
        return f"{'n/a':{width}}"
    return f"{value:{width}{fmt}}"


class Report:
    """Rank 0's output: a table streamed row by row, or CSV/JSON written at the end."""

    def __init__(self, args: argparse.Namespace, n: int, out: TextIO,
                 peers: Sequence[Any] = ()) -> None:
        self.args, self.n, self.out, self.peers = args, n, out, peers
        self.columns = list(_TABLE_COLUMNS)
        for peer in peers:
            self.columns += _peer_columns(peer.name)
        if args.floor:
            self.columns += _FLOOR_COLUMNS
        self.table = not (args.csv or args.json)

    def start(self) -> None:
        if not self.table:
            return
        a = self.args
        factors = ", ".join(f"{op} {busbw_factor(op, self.n):.3g}" for op in a.op)
        def rule(given: Optional[int], small: int, large: int) -> str:
            return str(given) if given is not None else (
                f"{small} up to {SMALL_CASE_BYTES // 1024} KiB ({large} above)")
        calls = (f"{rule(a.warmup, SMALL_WARMUP, LARGE_WARMUP)} warm-up + "
                 f"{rule(a.iters, SMALL_ITERS, LARGE_ITERS)} timed calls")
        self._line(f"# ddl-bench: {self.n} rank{'s' * (self.n != 1)}, {a.dtype}; per row "
                   f"{calls}; {a.reduce_op.capitalize()} reductions, broadcast root 0")
        self._line("# time(us): mean over the timed calls made back to back, slowest rank, "
                   "in microseconds" if a.timing == "loop" else
                   "# time(us): median over the calls of the slowest rank's time per call, "
                   "in microseconds")
        self._line(f"# algbw = size / time; busbw = algbw * factor ({factors})")
        if a.device == "cuda":
            self._line("# inputs: CuPy arrays on GPU local_rank % device_count (Gloo and "
                       "NCCL: torch CUDA tensors there); each timed block ends when the GPU "
                       "has finished")
        for peer in self.peers:
            self._line(f"# {peer.name}: {peer.describe()}, on the same input; "
                       f"{peer.name}/ddl > 1 means ddl is faster")
            if a.dtype not in peer.dtypes:
                self._line(f"# {peer.name}: n/a, it does not support {a.dtype}")
        if a.floor:
            self._line(f"# floor(us): above {FLOOR_MIN_BYTES // 1024} KiB the copy floor, "
                       f"every rank copies size bytes once (np.copyto), all at once after "
                       f"a barrier (slowest rank, median over the copies); up to it the "
                       f"pingpong floor, half the median round trip of size bytes "
                       f"between ranks 0 and 1 through shared memory (Python spinning on a flag); "
                       f"ddl/floor = time / floor")
        self._line("#")
        self._line(" ".join(f"{h:{w}}" for h, _, w, _ in self.columns))

    def row(self, row: Dict[str, Any]) -> None:
        if self.table:
            self._line(" ".join(_cell(row[f], w, fmt) for _, f, w, fmt in self.columns))

    def finish(self, rows: List[Dict[str, Any]]) -> None:
        if self.args.csv:
            self.out.write(format_csv(rows))
        elif self.args.json:
            self.out.write(format_json(rows))
        else:
            wrong = sum(is_wrong(r) for r in rows)
            self._line(f"# {len(rows)} rows, " + (
                "every result correct" if not wrong else f"{wrong} with WRONG results"))
        self.out.flush()

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def format_csv(rows: List[Dict[str, Any]]) -> str:
    """``rows`` as CSV with a header line; a missing value is an empty field."""
    if not rows:
        return ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def format_json(rows: List[Dict[str, Any]]) -> str:
    """``rows`` as a JSON list of objects, one row per line; a missing value is null."""
    return "[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n"
