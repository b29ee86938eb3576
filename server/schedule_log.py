"""A job's ``set_schedule`` changes since its snapshots: what NOTE [Schedule changes kept between
snapshots] in snapshot.py keeps on disk and replays after a restore. Apart from the job because
it is its own bookkeeping (numbers, steps, trimming, replay), read by the job at three moments:
a change, a restore and each step's opening."""

from __future__ import annotations

from typing import Any

import msgspec

from wstream.protocol import messages as m

from .snapshot import SnapshotError

SCHEDULE_LOG_KEPT = 1024
"""Changes the log keeps beyond those after the newest snapshot (rule 5)."""

Entry = tuple[int, int, Any]
"""(number, step it applies from, the optimizer spec from then on)."""


class ScheduleLog:
    """One job's numbered schedule changes, and those a restored job has yet to replay."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.seq = 0
        """The number of the newest change."""
        self.snapshot_seq = 0
        """The number of the last change the newest snapshot holds (``JobRecord.schedule_seq``)."""
        self.pending: list[tuple[int, Any]] = []
        """Replayed changes (step, spec) of steps a restored job has yet to open, in order."""

    def add(self, step: int, spec: Any) -> None:
        """A change made while the job gathers ``step`` (rules 1, 4 and 5)."""
        self.seq += 1
        kept = [e for e in self.entries if e[1] <= step]  # rule 4: changes of later steps are overtaken
        kept.append((self.seq, step, spec))
        while len(kept) > SCHEDULE_LOG_KEPT and kept[0][0] <= self.snapshot_seq:
            kept.pop(0)
        self.entries = kept
        self.pending = []

    @property
    def long(self) -> bool:
        """More changes since the newest snapshot than the log keeps (rule 5): a snapshot is due."""
        return sum(1 for e in self.entries if e[0] > self.snapshot_seq) > SCHEDULE_LOG_KEPT

    def to_json(self) -> list[dict[str, Any]]:
        return [{"seq": n, "step": c, "optimizer": msgspec.to_builtins(spec)} for n, c, spec in self.entries]

    def resume(self, entries: list[dict[str, Any]], step: int, kind: type, job: str) -> Any:
        """Take the logged ``entries`` of a job restored at ``step``, whose optimizer specs are of
        ``kind`` (rule 3): returns the spec to use now (None: the snapshot's), and keeps the later
        ones for :meth:`opened`. A damaged entry raises :class:`SnapshotError`."""
        log: list[Entry] = []
        for e in entries:
            try:
                n, c = e["seq"], e["step"]
                if type(n) is not int or type(c) is not int or n < 1 or not 0 <= c <= m.MAX_STEP:
                    raise ValueError(f"seq {n!r} and step {c!r} must be whole numbers in range")
                log.append((n, c, msgspec.convert(e["optimizer"], kind)))
            except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
                raise SnapshotError(f"the schedule log of job {job!r} is damaged: {exc}") from exc
        log.sort(key=lambda e: e[0])
        self.entries = log
        self.seq = max([self.seq, *(n for n, _, _ in log)])
        after = [(c, spec) for n, c, spec in log if n > self.snapshot_seq]
        now = [spec for c, spec in after if c <= step]
        self.pending = [(c, spec) for c, spec in after if c > step]
        return now[-1] if now else None

    def opened(self, step: int) -> list[Any]:
        """The replayed changes that take effect as the job opens ``step``, in order."""
        due = []
        while self.pending and self.pending[0][0] <= step:
            due.append(self.pending.pop(0)[1])
        return due
