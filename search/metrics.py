"""What a run records while it trains: the step metrics and the reference subnets' accuracy.

:class:`MetricsWriter` (main rank) takes one record per training step and writes it as it comes:

- ``metrics.jsonl``: one JSON object per step, keys :data:`STEP_FIELDS` (``nonfinite`` only on a
  step whose loss is not finite), plus the monitor columns on a step after which the reference
  subnets were scored;
- ``metrics.csv``: the same rows, one column per key (the arch as JSON, null as empty);
- ``tb/`` (when ``tensorboard`` is importable and ``train.tensorboard`` is not false): TensorBoard
  scalars ``train/<key>``, ``memory/<key>`` and ``monitor/<name>`` at the record's step.

A resumed run keeps the lines of the steps before the resume point (those after it will run
again), rebuilds the CSV from them, and opens the TensorBoard writer with ``purge_step`` at the
resume point, so TensorBoard hides the events of the steps that run again.

:class:`Monitor` scores a few fixed reference subnets (:func:`reference_archs`: the smallest, a
middle one and the largest by parameters, or ``train.monitor_archs``) every ``train.monitor_every``
steps, as the search scores a candidate (inherited weights, batch norm recalibrated then restored:
training is unchanged).
"""
from __future__ import annotations

import csv
import io
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.files import atomic_write_text
from supernet import Arch, SearchSpace

if TYPE_CHECKING:
    from pipeline import Engine

    from .evolution import SubnetCost

__all__ = ["METRICS_NAME", "CSV_NAME", "TB_DIR", "MEMORY_FIELDS", "ACTIVATION_FIELDS", "STEP_FIELDS", "MetricsWriter", "Monitor",
           "reference_archs", "tensorboard_available"]

METRICS_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"
TB_DIR = "tb"
# the tensor manager's per-step counters (null when it reports none)
MEMORY_FIELDS = ("resident_bytes_peak", "fetched_bytes", "written_back_bytes", "hit_rate", "stall_s")
# this rank's saved activations per step (memory.activations): swapped, recomputed, peered
ACTIVATION_FIELDS = ("swapped_bytes", "recomputed_ops", "peered_bytes")
# a step record's keys, in the order written (the CSV's first columns)
STEP_FIELDS = ("step", "arch", "loss", "lr", "samples_per_s", "seconds", "migrated_ops", "migrated_bytes",
               "migration_s", *MEMORY_FIELDS, *ACTIVATION_FIELDS, "nonfinite")
TB_FLUSH_S = 2.0  # TensorBoard's writer thread flushes at least this often: a watcher sees the run live


def tensorboard_available() -> bool:
    """Whether TensorBoard scalars can be written (``torch.utils.tensorboard`` needs the
    ``tensorboard`` package: ``pip install 'pipenas[tensorboard]'``)."""
    try:
        import tensorboard  # noqa: F401 - torch.utils.tensorboard may be cached; the package may not
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def _after_earlier_event_files(tb_dir: Path) -> None:
    """Wait, if need be, until a new event file's name sorts after every earlier one's. TensorBoard
    reads a run's files in name order; a name is ``events.out.tfevents.<second>.<host>.<pid>.<n>``
    with the pid and a per-process counter unpadded, so a writer made in the same second as the one
    before it (a resume in the same process, or a restart within the second) may sort first, and
    the earlier file's steps then purge the resumed ones. At most a second, only then."""
    stamps = [int(part) for f in tb_dir.glob("events.out.tfevents.*")
              if (part := f.name.split(".")[3]).isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(max(stamps) + 1.01 - time.time())


class MetricsWriter:
    """``metrics.jsonl``, ``metrics.csv`` and TensorBoard scalars of the run in ``out``, from
    step ``start`` on (see the module's docstring). ``monitor_columns``: the keys the monitor
    adds (:attr:`Monitor.columns`). ``tensorboard``: ``"auto"`` (when installed), true or false."""

    def __init__(self, out: Path, start: int, monitor_columns: Sequence[str] = (),
                 tensorboard: str | bool = "auto") -> None:
        self.jsonl_path, self.csv_path = out / METRICS_NAME, out / CSV_NAME
        kept = _kept(self.jsonl_path, start)
        #: the losses of the steps kept (NaN where not finite)
        self.losses = [math.nan if r.get("loss") is None else float(r["loss"]) for _, r in kept]
        columns = list(dict.fromkeys([*STEP_FIELDS, *monitor_columns]))
        columns += [k for k in dict.fromkeys(k for _, r in kept for k in r) if k not in columns]  # older columns
        atomic_write_text(self.jsonl_path, "".join(line + "\n" for line, _ in kept))
        head = io.StringIO()  # the CSV of the lines kept, rebuilt from them (a crash can cut a row short)
        writer = csv.DictWriter(head, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(_cells(rec) for _, rec in kept)
        atomic_write_text(self.csv_path, head.getvalue())
        self.jsonl = self.jsonl_path.open("a")
        self.csv_file = self.csv_path.open("a", newline="")
        self.csv = csv.DictWriter(self.csv_file, fieldnames=columns, lineterminator="\n")  # a key not here fails
        self.tb = None
        if tensorboard is True or (tensorboard == "auto" and tensorboard_available()):
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides earlier events of steps >= start (they run again)
            _after_earlier_event_files(out / TB_DIR)
            self.tb = SummaryWriter(str(out / TB_DIR), purge_step=start, flush_secs=TB_FLUSH_S)
        self._held: dict[str, Any] | None = None

    def step(self, record: Mapping[str, Any], hold: bool = False) -> None:
        """One training step's record. ``hold``: keep it back for :meth:`monitored` to add the
        reference subnets' accuracies to (it is written then, or by the next call or :meth:`close`)."""
        self._release()
        self._held = dict(record)
        if not hold:
            self._release()

    def monitored(self, values: Mapping[str, float | None]) -> None:
        """Add the monitor's columns to the record held back, and write it."""
        if self._held is None:
            raise RuntimeError("MetricsWriter.monitored: no step record held back (step(..., hold=True) first)")
        self._held.update({k: _finite(v) for k, v in values.items()})
        self._release()
        if self.tb is not None:
            self.tb.flush()

    def _release(self) -> None:
        rec, self._held = self._held, None
        if rec is None:
            return
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        self.csv.writerow(_cells(rec))
        self.csv_file.flush()
        if self.tb is not None:  # one event of every scalar: add_scalar's event each costs ~1 ms a step
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=_tag(k), simple_value=float(v)) for k, v in rec.items()
                      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
            self.tb._get_file_writer().add_summary(Summary(value=values), rec["step"])

    def close(self) -> None:
        """Write any record held back and close the files."""
        try:
            self._release()
        finally:
            self.jsonl.close()
            self.csv_file.close()
            if self.tb is not None:
                self.tb.close()


def _kept(path: Path, start: int) -> list[tuple[str, dict[str, Any]]]:
    """The lines of steps before ``start`` (a run that died after its last checkpoint logged
    steps that will run again), with their records."""
    kept = []
    if start > 0 and path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < start:
                kept.append((line, rec))
    return kept


def _cells(rec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: "" if v is None else json.dumps(v) if isinstance(v, (dict, list, bool)) else v for k, v in rec.items()}


def _tag(key: str) -> str:
    if key.startswith("monitor"):  # monitor/<name>, monitor_s
        return key if "/" in key else f"monitor/{key}"
    return f"memory/{key}" if key in MEMORY_FIELDS or key in ACTIVATION_FIELDS else f"train/{key}"


def _first(batches: Sequence[Any], n: int) -> list[Any]:
    """The first ``n`` samples of ``batches`` (x, y), as batches (the last one cut)."""
    out = []
    for x, y in batches:
        if n <= 0:
            break
        out.append((x[:n], y[:n]))
        n -= len(y)
    return out


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None  # JSON has no NaN


# -- the reference subnets ---------------------------------------------------------------------

def reference_archs(space: SearchSpace, cost: SubnetCost, archs: Sequence[Mapping[str, Any]] | None = None,
                    field: str = "train.monitor_archs") -> dict[str, Arch]:
    """Name -> arch of the subnets to monitor: ``archs`` (``arch0``, ``arch1``, ...; each checked
    against ``space``, errors naming ``field[i]``), or by parameter count ``smallest``, ``middle``
    and ``largest``: every slot's candidate with the fewest parameters, its median one, its most.
    The slots' counts add up independently (a slot's candidates read and produce the same shapes),
    as in :meth:`SubnetCost.cheapest`. An arch that comes twice is kept once, by its first name."""
    if archs is not None:
        named = {f"arch{i}": space.validate(a, f"{field}[{i}]") for i, a in enumerate(archs)}
    else:
        base = {c.label: c.values[0] for c in space.choices}
        ranked = {c.label: sorted(c.values, key=lambda v, c=c: cost.params(Arch({**base, c.label: v})))
                  for c in space.choices}
        named = {name: Arch({label: values[pick(len(values))] for label, values in ranked.items()})
                 for name, pick in (("smallest", lambda n: 0), ("middle", lambda n: (n - 1) // 2),
                                    ("largest", lambda n: n - 1))}
    seen: set[Arch] = set()
    return {k: a for k, a in named.items() if not (a in seen or seen.add(a))}


class Monitor:
    """The reference subnets ``archs`` (name -> arch), scored after every ``every`` training
    steps on the validation batches ``val`` (their first ``samples`` samples; ``None``: all) with
    batch norm recalibrated on ``calib`` (``engine.evaluate``: the statistics are restored after,
    so training is unchanged). ``every`` 0: never."""

    def __init__(self, archs: Mapping[str, Arch], every: int, val: Sequence[Any], calib: Sequence[Any],
                 samples: int | None = None) -> None:
        self.archs, self.every, self.calib = dict(archs), every, list(calib)
        self.val = list(val) if samples is None else _first(val, samples)

    @property
    def columns(self) -> tuple[str, ...]:
        """The keys :meth:`evaluate` returns: each subnet's ``monitor/<name>`` and ``monitor_s``."""
        return (*(f"monitor/{n}" for n in self.archs), "monitor_s") if self.every else ()

    def due(self, start: int, end: int) -> bool:
        """Whether to score after training steps ``[start, end)``: they reach a multiple of
        ``every`` steps trained. A cross-subnet segment (many steps, nothing in flight at its
        end) is scored at its end when it reaches one: the record says the step."""
        return self.every > 0 and end // self.every > start // self.every

    def evaluate(self, engine: Engine) -> dict[str, float | None]:
        """Score every reference subnet: their accuracy (null where the loss is not finite) and
        the seconds it took. Collective: every rank calls it after the same step."""
        t0 = time.perf_counter()
        out: dict[str, float | None] = {}
        for name, arch in self.archs.items():
            ev = engine.evaluate(arch, self.val, self.calib)
            out[f"monitor/{name}"] = ev.accuracy if math.isfinite(ev.loss) else None
        out["monitor_s"] = round(time.perf_counter() - t0, 4)
        return out
