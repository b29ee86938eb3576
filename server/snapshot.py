"""Snapshots of a job's state on disk: one consistent step, written atomically, verified on load.

Layout under the server's ``--store`` directory::

    job-<name>/step-000000001200/manifest.json        the job's metadata and every file's sha256
    job-<name>/step-000000001200/shard-00000.safetensors   "<stage>.master", "<stage>.opt.<key>",
                                                      "<stage>.previous" (a delayed job's, rule 5)
    job-<name>/.tmp-...                               a snapshot being written (removed at start)

# NOTE [Consistent snapshots while training goes on]
# 1. A snapshot of step t starts only when every stage is at version t and none is updating
#    (``Job.consistent_step``): just after stage 0's update of step t-1, or at once on an idle job.
# 2. From then on each stage's state of version t is *captured* (cloned) exactly once, before
#    anything changes it: either by the writer thread, which walks the stages in the order backward
#    updates them (last first), or by the update t -> t+1 itself, which captures first if the
#    writer has not reached the stage yet. Both run under the stage's lock, so a capture never
#    sees half an update.
# 3. An update whose capture finds more than ``buffer_bytes`` of clones waiting to be written is
#    *parked* instead (``capture_before_update`` returns False, nothing changed): the extra memory
#    of a snapshot is bounded, and training slows to disk speed only when the disk cannot keep up.
#    A parked update gives its pool thread back at once, so one job's slow disk never stalls
#    another job's tasks (a waiting update used to hold the pool's only thread); it is resumed
#    (submitted again) by whoever makes room: the writer releasing a clone, the writer capturing
#    that very stage itself, the end of the write (``close``) or its cancellation.
# 4. Files are written to a temporary directory, each fsynced; the manifest (with every file's
#    sha256) last; then the directory is renamed into place and its parent fsynced. A crash at
#    any moment leaves either the complete new snapshot or none of it.
# 5. A delayed job's step t reads the weights of version t - 1 (NOTE [Versions and who may read
#    what] rule 5 in versions.py), which a snapshot of version t alone does not hold: restored
#    from it, step t would read version t, and the run would leave the one never stopped. So its
#    snapshot (``Snapshot.previous``) also keeps each stage's published copy of version t - 1
#    (``previous``: the other slot, in the compute dtype, exactly what the workers read), captured
#    before the update t -> t + 1 writes that slot (rule 2), and a restore puts it back in its slot
#    (``Job.restore``). A snapshot without it (an older server's, or of the step a restore began
#    at, whose version before is gone) restores as before: step t then reads version t.
#
# NOTE [Schedule changes kept between snapshots]
# ``set_schedule`` changes a job's lr and schedule from its open step c on. Writing a whole
# snapshot to keep it costs the job's size (seconds to minutes); instead:
# 1. Each change gets the next number n of the job and is appended to
#    ``job-<name>/schedule-log.json`` as (n, c, the optimizer spec from then on), durably, before
#    it is answered (a failed write is answered ``internal``: the change holds on the live job).
# 2. A snapshot's record says the number of the last change its options hold
#    (``JobRecord.schedule_seq``).
# 3. A job restored from a snapshot of step s applies the logged changes numbered after that, in
#    order: those of step c = s at once (a change made after the record was taken has c >= s),
#    the others as their step opens (``Job.step_opened``). So the steps replayed from s run under
#    the specs they first ran under, and a run killed after a change ends as one that was not.
#    Changes the snapshot holds are never applied again (a change whose log write failed is in
#    the next snapshot, and an older logged one must not overwrite it).
# 4. A change of a step past the open one (logged before a restore to an older snapshot, not
#    replayed yet) is dropped when a new change comes: the new one overtakes it.
# 5. The log keeps every change after the newest snapshot, and older ones up to
#    ``schedule_log.SCHEDULE_LOG_KEPT`` in all (for a restore that falls back to an older snapshot); past that
#    many since the newest snapshot, a snapshot is asked for, after which they can go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from wstream.protocol import messages as m
from wstream.protocol.auth import client_key_of_digest, verifier

from .ownership import HeldElsewhere, OwnerLock, holder

log = logging.getLogger(__name__)

FORMAT = 1
SHARD_BYTES = 256 * 2**20
"""Stages are grouped into files of about this size (one file per stage would mean thousands of
fsyncs for a deep model; one file for all would need the whole state in memory at once)."""
PROGRESS_EVERY_S = 10.0
"""A resume that takes longer than this logs how far it got, this often (a big job's state takes
minutes to read back)."""


class SnapshotError(Exception):
    """A snapshot on disk cannot be used (missing file, wrong checksum, unreadable manifest)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe(directory: Path) -> None:
    """Create, write, fsync and remove a file in ``directory``: what a snapshot will need."""
    path = directory / f".wstream-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _write_file(path, b"wstream store probe\n")
    finally:
        path.unlink(missing_ok=True)


_FLAT_OPTIONS = ("optimizer", "dtype", "double_buffer", "delayed_update", "delay_after", "frozen", "base")
"""The keys a manifest written before protocol 3 holds the job's options under, at its top level."""


LEGACY_DIGEST = "token_sha256"
"""The manifest key under which protocol 4 and earlier stored SHA-256(token), which was the very key
attach proofs were made with: a copy of the store opened the job. Read once, then rewritten as
``token_verifier`` (:meth:`SnapshotStore.migrate_manifests`)."""


@dataclass(slots=True)
class JobRecord:
    """What a snapshot stores besides tensors: enough to re-create the job after a restart."""

    name: str
    verifier: bytes
    """The token's verifier (NOTE [Signed requests] in ``protocol/auth.py``): it checks attach
    proofs but cannot make one, so a copy of the store does not open the job."""
    options: m.JobOptions
    specs: list[m.StageSpec]
    incarnation: bytes = field(default_factory=lambda: os.urandom(32))
    """Made at creation and kept across restarts (``Attached.incarnation``): a job dropped and
    created again under its name has another, so a worker of the old one cannot join the new."""
    schedule_seq: int = 0
    """The number of the last schedule change ``options`` holds (NOTE [Schedule changes kept
    between snapshots]): a restore applies the logged ones after it."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "token_verifier": self.verifier.hex(),
            "options": msgspec.to_builtins(self.options),
            "stages": [msgspec.to_builtins(s) for s in self.specs],
            "incarnation": self.incarnation.hex(),
            "schedule_seq": self.schedule_seq,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        """Also reads a manifest written before protocol 3, whose options are top-level keys, and
        one written before protocol 5, which holds the token's digest (:data:`LEGACY_DIGEST`)."""
        options = d["options"] if "options" in d else {k: d[k] for k in _FLAT_OPTIONS if k in d}
        if "token_verifier" in d:
            vk = bytes.fromhex(d["token_verifier"])
        else:
            vk = verifier(client_key_of_digest(bytes.fromhex(d[LEGACY_DIGEST])))
        return cls(
            name=d["name"],
            verifier=vk,
            options=msgspec.convert(options, m.JobOptions),
            specs=[msgspec.convert(s, m.StageSpec) for s in d["stages"]],
            # a manifest from before protocol 9 has none: a new one (workers of before the restart had none either)
            incarnation=bytes.fromhex(d["incarnation"]) if "incarnation" in d else os.urandom(32),
            schedule_seq=int(d.get("schedule_seq", 0)),
        )


@dataclass(slots=True, frozen=True)
class Waiter:
    """A request answered when a snapshot is durable: ``reply(step, path)`` makes the answer."""

    identity: bytes
    request_id: int
    reply: Callable[[int, str], m.Message]


SCHEDULE_LOG = "schedule-log.json"

Capture = Callable[[bool], dict[str, torch.Tensor]]
"""A stage's capture: copies of what a snapshot keeps of it (with the published copy of the version
before, when told: rule 5)."""


@dataclass(slots=True)
class Snapshot:
    """One snapshot of one job in progress (see the NOTE above)."""

    record: JobRecord
    step: int
    buffer_bytes: int
    reason: str
    started: float = field(default_factory=time.monotonic)
    waiters: list[Waiter] = field(default_factory=list)  # requests answered once it is durable
    captured: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # stages captured (by either side)
    clone_bytes: int = 0
    cancelled: bool = False
    closed: bool = False  # the write is over (``close``)
    parked: dict[int, tuple[int, Callable[[], None]]] = field(default_factory=dict)
    """Updates waiting for room in the buffer (rule 3): stage index -> (bytes it will clone, resume)."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    path: Path | None = None
    bytes_written: int = 0
    previous: bool = False
    """Capture each stage's published copy of version ``step - 1`` too (rule 5)."""

    def capture_before_update(self, index: int, lock: threading.Lock, capture: Capture,
                              nbytes: int, resume: Callable[[], None]) -> bool:
        """Called by the update of ``index`` from version ``step``: capture first (rule 2). False:
        no room (rule 3), the update must not run now; ``resume`` is called once there is."""
        with lock, self.cond:
            if index in self.done or self.cancelled or self.closed:
                return True
            if self.clone_bytes + nbytes > self.buffer_bytes and self.clone_bytes > 0:
                self.parked[index] = (nbytes, resume)
                return False
            self.captured[index] = capture(self.previous)
            self.done.add(index)
            self.clone_bytes += nbytes
            return True

    def take(
        self, index: int, lock: threading.Lock, capture: Capture
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """The writer's turn for ``index``: the clone an update made (and True: :meth:`release` it),
        or a capture now (False). Told under the lock: an update may capture the stage until then."""
        with lock, self.cond:
            if index in self.captured:
                return self.captured.pop(index), True
            self.done.add(index)
            tensors = capture(self.previous)
            resumed = self._resumable()  # the update of ``index``, if parked, has nothing to capture now
        for resume in resumed:
            resume()
        return tensors, False

    def release(self, tensors: dict[str, torch.Tensor], from_update: bool) -> None:
        if not from_update:
            return
        with self.cond:
            self.clone_bytes -= sum(t.numel() * t.element_size() for t in tensors.values())
            resumed = self._resumable()
            self.cond.notify_all()
        for resume in resumed:
            resume()

    def close(self) -> None:
        """The write is over (written or failed): updates capture nothing more, the parked go on."""
        with self.cond:
            self.closed = True
            resumed = self._resumable()
        for resume in resumed:
            resume()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.captured.clear()
            self.clone_bytes = 0
            resumed = self._resumable()
            self.cond.notify_all()
        for resume in resumed:
            resume()

    def _resumable(self) -> list[Callable[[], None]]:
        """Under ``cond``: take out the parked updates that can go on now (rule 3), oldest first.
        The room is shared out as an estimate: one that finds none after all is parked again."""
        room, empty = self.buffer_bytes - self.clone_bytes, self.clone_bytes == 0
        out = []
        for index, (nbytes, resume) in list(self.parked.items()):
            if not (index in self.done or self.cancelled or self.closed):
                if not empty and nbytes > room:
                    continue
                room, empty = room - nbytes, False
            del self.parked[index]
            out.append(resume)
        return out


LOCK_FILE = ".wstream-server.lock"
"""Beside the job directories: locked by the server that uses the store (server/ownership.py)."""


class SnapshotStore:
    """The snapshots of every job under one directory; keeps the newest ``keep`` per job."""

    def __init__(self, root: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 snapshot per job, got {keep}")
        self.root = Path(root)
        self.keep = keep
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise OSError(f"cannot create the store directory {root}: {exc.strerror or exc}") from None
        try:  # one server per store: another's drop would delete this one's live files
            self._lock = OwnerLock(self.root / LOCK_FILE)
        except HeldElsewhere as exc:
            raise OSError(f"store {root} is in use by {holder(exc.pid)}") from None
        except OSError as exc:
            raise OSError(f"the store {root} is not writable: {exc.strerror or exc} (its lock file {LOCK_FILE})") from None
        try:  # found now rather than at the first snapshot, after hours of training
            _probe(self.root)
        except OSError as exc:
            self._lock.release()
            raise OSError(
                f"the store {root} is not writable: {exc.strerror or exc} (a probe file could not be written, "
                "so no snapshot could be)"
            ) from None

    def close(self) -> None:
        """Give the store up (another server may open it from now on)."""
        self._lock.release()

    def job_dir(self, name: str) -> Path:
        return self.root / f"job-{name}"

    def remove_partial(self) -> None:
        """Delete temporary directories left by a crash in the middle of writing (rule 4), what is
        left of dropped jobs (:meth:`take_out`), and job directories holding no snapshot (a write
        that began as its job was dropped)."""
        for tmp in self.root.glob("job-*/.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("removed an unfinished snapshot %s", tmp)
        for replaced in self.root.glob("job-*/.replaced-step-*"):  # a crash while a step's snapshot was replaced
            final = replaced.parent / replaced.name[len(".replaced-") :].rsplit("-", 1)[0]
            if final.exists():
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                os.rename(replaced, final)
                log.info("put back %s: a crash came as it was being replaced", final)
        for dropped in self.root.glob(".dropped-*"):
            shutil.rmtree(dropped, ignore_errors=True)
            log.info("removed what was left of a dropped job, %s", dropped)
        for job_dir in self.root.glob("job-*"):
            if job_dir.is_dir() and not any(p.name.startswith("step-") for p in job_dir.iterdir()):
                for left in job_dir.glob(f"{SCHEDULE_LOG}*"):  # a schedule log of a creation that never finished
                    left.unlink()
                try:
                    job_dir.rmdir()
                except OSError as exc:  # (a mount point): left, as the other leftovers' errors are; it holds no snapshot
                    log.warning("could not remove the empty job directory %s: %s", job_dir, exc)

    def take_out(self, name: str) -> Path | None:
        """Take job ``name``'s directory out of the store now (renamed, and the rename made
        durable), so that a restart does not resume it; returns where it went, for deleting later
        (:meth:`remove_partial` finishes that after a crash). None: it had none."""
        src = self.job_dir(name)
        dst = self.root / f".dropped-{name}-{secrets.token_hex(4)}"
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        _fsync_dir(self.root)
        return dst

    def jobs(self) -> list[str]:
        return sorted(p.name[4:] for p in self.root.glob("job-*") if p.is_dir())

    # ---- schedule changes (NOTE [Schedule changes kept between snapshots]) -----------------------
    def write_schedule_log(self, name: str, entries: list[dict[str, Any]]) -> None:
        """Replace job ``name``'s log of schedule changes, durably (written, fsynced, renamed)."""
        job_dir = self.job_dir(name)
        job_dir.mkdir(exist_ok=True, mode=0o700)  # (a job whose creation snapshot is still being written)
        tmp = job_dir / f"{SCHEDULE_LOG}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(entries).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, job_dir / SCHEDULE_LOG)
        _fsync_dir(job_dir)

    def read_schedule_log(self, name: str) -> list[dict[str, Any]]:
        """Job ``name``'s schedule changes, oldest first (none: an empty list)."""
        try:
            entries = json.loads((self.job_dir(name) / SCHEDULE_LOG).read_text())
        except FileNotFoundError:
            return []
        except (ValueError, RecursionError) as exc:
            raise SnapshotError(f"{SCHEDULE_LOG} of job {name!r} is not JSON: {exc}") from exc
        if not isinstance(entries, list):
            raise SnapshotError(f"{SCHEDULE_LOG} of job {name!r} is not a list")
        return entries

    def snapshots(self, name: str) -> list[Path]:
        """This job's complete snapshots, newest first."""
        return sorted(self.job_dir(name).glob("step-*"), reverse=True)

    # ---- writing (the writer thread) ------------------------------------------------------------
    def write(
        self,
        snap: Snapshot,
        stages: list[tuple[threading.Lock, Capture]],
    ) -> Path | None:
        """Write ``snap``; returns its directory, or None when it was cancelled (job dropped)."""
        job_dir = self.job_dir(snap.record.name)
        job_dir.mkdir(exist_ok=True, mode=0o700)
        tmp = job_dir / f".tmp-step-{snap.step:012d}-{secrets.token_hex(4)}"
        tmp.mkdir(mode=0o700)
        try:
            files = self._write_shards(snap, stages, tmp)
            if files is None:
                shutil.rmtree(tmp, ignore_errors=True)
                return None
            manifest = {
                "format": FORMAT,
                "step": snap.step,
                "created_unix": time.time(),
                "job": snap.record.to_json(),
                "files": files,
            }
            _write_file(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            final = job_dir / f"step-{snap.step:012d}"
            replaced = None
            if final.exists():  # the same step saved again (a save after a schedule change, on an idle job)
                replaced = job_dir / f".replaced-{final.name}-{secrets.token_hex(4)}"
                os.rename(final, replaced)  # kept until the new one is in place (a start puts it back)
            os.rename(tmp, final)
            _fsync_dir(job_dir)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.snapshots(snap.record.name)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _write_shards(
        self, snap: Snapshot, stages: list[tuple[threading.Lock, Capture]], tmp: Path
    ) -> list[dict[str, Any]] | None:
        files: list[dict[str, Any]] = []
        shard: dict[str, torch.Tensor] = {}
        shard_stages: list[int] = []
        size = 0
        for i in reversed(range(len(stages))):  # the order backward updates them (rule 2)
            if snap.cancelled:
                return None
            lock, capture = stages[i]
            tensors, from_update = snap.take(i, lock, capture)
            for k, t in tensors.items():
                shard[f"{i}.{k}"] = t
            size += sum(t.numel() * t.element_size() for t in tensors.values())
            shard_stages.append(i)
            snap.release(tensors, from_update)
            if size >= SHARD_BYTES or i == 0:
                name = f"shard-{len(files):05d}.safetensors"
                data = save_safetensors(shard, metadata={"step": str(snap.step)})
                _write_file(tmp / name, data)
                files.append({
                    "name": name,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "bytes": len(data),
                    "stages": sorted(shard_stages),
                })
                snap.bytes_written += len(data)
                shard, shard_stages, size = {}, [], 0
        return files

    # ---- reading --------------------------------------------------------------------------------
    def load_latest(self, name: str) -> tuple[int, JobRecord, Iterator[tuple[int, dict[str, torch.Tensor]]], Path]:
        """The newest intact snapshot of job ``name``: (step, record, stage tensors, path).

        Every file's checksum is verified before anything is returned; a damaged snapshot is
        skipped (logged) for the next older one. Raises SnapshotError when none is intact."""
        self.migrate_manifests(name)
        problems = []
        for path in self.snapshots(name):
            try:
                step, record, shards = self._verify(path)
            except SnapshotError as exc:
                log.warning("snapshot %s is damaged (%s); trying an older one", path, exc)
                problems.append(f"{path.name}: {exc}")
                continue
            return step, record, _stage_tensors(path, shards), path
        raise SnapshotError(f"job {name!r} has no intact snapshot in {self.job_dir(name)}: {problems or 'none'}")

    def migrate_manifests(self, name: str) -> None:
        """Rewrite each manifest of job ``name`` that holds the token's digest (protocol 4 and
        earlier: the key itself) to hold its verifier instead, atomically; logged. A manifest that
        cannot be read is left for :meth:`load_latest` to report."""
        for path in self.snapshots(name):
            manifest_path = path / "manifest.json"
            try:
                manifest = json.loads(manifest_path.read_bytes())
                job = manifest["job"]
                if LEGACY_DIGEST not in job:
                    continue
                record = JobRecord.from_json(job)
                manifest["job"] = {**{k: v for k, v in job.items() if k != LEGACY_DIGEST}, **record.to_json()}
            except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError):
                continue
            tmp = path / f".manifest-{secrets.token_hex(4)}.json"
            try:
                _write_file(tmp, json.dumps(manifest, indent=1).encode())
                os.replace(tmp, manifest_path)
                _fsync_dir(path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.warning("snapshot %s holds the token's digest (%s) and could not be rewritten: %s",
                            path, LEGACY_DIGEST, exc)
                continue
            log.warning(
                "snapshot %s: replaced the token's digest (%s, which opened the job) by its verifier "
                "(protocol 5); copies of this store made before now still open job %r: if any may have "
                "leaked, create the job again with a new token",
                path, LEGACY_DIGEST, name,
            )

    def _verify(self, path: Path) -> tuple[int, JobRecord, list[dict[str, Any]]]:
        try:
            manifest = json.loads((path / "manifest.json").read_bytes())
            if manifest.get("format") != FORMAT:
                raise SnapshotError(f"format {manifest.get('format')!r}, this server reads {FORMAT}")
            record = JobRecord.from_json(manifest["job"])
            step = int(manifest["step"])
            shards = manifest["files"]
            for f in shards:
                if _file_sha256(path / f["name"]) != (f["bytes"], f["sha256"]):
                    raise SnapshotError(f"{f['name']} does not match its size and checksum")
        except SnapshotError:
            raise
        except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError) as exc:
            raise SnapshotError(f"{type(exc).__name__}: {exc}") from None
        covered = sorted(i for f in manifest["files"] for i in f["stages"])
        if covered != list(range(len(record.specs))):
            raise SnapshotError("the files do not hold every stage exactly once")
        return step, record, shards


def _file_sha256(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _stage_tensors(path: Path, shards: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(stage, {"master": ..., "opt.<key>": ...}) for every stage in stage order, one file in
    memory at a time (files hold descending ranges of stages: the writer goes last to first).
    Logs progress every :data:`PROGRESS_EVERY_S` (the consumer's time included)."""
    total = sum(f["bytes"] for f in shards)
    done = 0
    last_log = time.monotonic()
    for f in sorted(shards, key=lambda f: min(f["stages"])):
        by_stage: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in load_file(path / f["name"]).items():
            stage, _, name = key.partition(".")
            by_stage.setdefault(int(stage), {})[name] = t
        for i in sorted(by_stage):
            yield i, by_stage.pop(i)
        done += f["bytes"]
        now = time.monotonic()
        if done < total and now - last_log >= PROGRESS_EVERY_S:
            log.info("loading %s: %d%% (%d of %d bytes)", path, 100 * done // total, done, total)
            last_log = now
