"""Before a resume: find the outputs a killed job left broken, and move them aside.

A job that writes `torch.save` files straight to their final path (SpecForge does) and resumes
by skipping files that exist treats a file truncated by the kill as done, forever. So before the
resume, the files written around the failure are checked, and the broken ones are moved to a
quarantine folder — never deleted, never overwriting anything — so the job writes them again.

What `validate_file` checks is in actions/filecheck.py; how a file is moved aside, in
actions/quarantine.py. This module walks the outputs tree and puts the two together.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat as _stat
from pathlib import Path
from typing import NamedTuple
from collections.abc import Callable, Collection, Iterable

from stallwatch.kernel import safefs
from stallwatch.kernel.proc import self_fd_path
from stallwatch.actions.filecheck import CRC_MAX_BYTES, FileCheck, validate_file
from stallwatch.actions.quarantine import ASIDE_SUFFIX, QUARANTINE_FULL, move_at
from stallwatch.clock import SYSTEM_CLOCK, Clock
from stallwatch.model import Frozen

__all__ = ["DEFAULT_PATTERNS", "Quarantined", "Skipped", "ValidationReport", "validate_outputs"]

DEFAULT_PATTERNS = ("*.pt", "*.ckpt", "*.pth", "*.safetensors", "*.ckpt.gz", "*.pt.gz")
MANIFEST = "MANIFEST.jsonl"


class Quarantined(NamedTuple):
    src: str
    dst: str
    reason: str


class Skipped(NamedTuple):
    path: str
    reason: str


class ValidationReport(Frozen):
    outputs_dir: str
    quarantine_dir: str
    since_wall: float | None
    dry_run: bool = False
    scanned: int = 0  # files seen in the walk (any name, any age)
    checked: int = 0  # files validated
    valid: int = 0
    quarantined: tuple[Quarantined, ...] = ()  # in a dry run: what would have been moved
    skipped: tuple[Skipped, ...] = ()  # candidates not checked, and why
    errors: tuple[str, ...] = ()  # broken files that could NOT be moved, walk errors
    notes: tuple[str, ...] = ()  # worth knowing, not in the way of a resume
    duration_s: float = 0.0

    @property
    def safe_to_resume(self) -> bool:
        """Every candidate was checked and every broken one moved aside."""
        return not self.errors and not self.skipped and not self.dry_run



# ------------------------------------------------------------------------------ the tree


def _matches(name: str, patterns: Collection[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class _Found(NamedTuple):
    mtime: float
    ident: tuple[int, int]


def _walk(out_fd: int, out_dir: Path, patterns: Collection[str], since_wall: float | None,
          skip_ident: tuple[int, int] | None, max_depth: int, errors: list[str],
          skipped: list[Skipped]) -> tuple[int, dict[tuple[str, ...], _Found]]:
    """Iterative (a stack of relative paths, no recursion), one open directory at a time,
    never below `max_depth` levels (a 1,500-deep tree is reported, not followed into a
    RecursionError). Returns (names seen, matching regular files)."""
    found: dict[tuple[str, ...], _Found] = {}
    scanned = 0
    stack: list[tuple[str, ...]] = [()]
    while stack:
        parts = stack.pop()
        try:
            dfd = safefs.open_rel(out_fd, parts)
        except FileNotFoundError:
            continue  # removed during the walk
        except OSError as exc:
            errors.append(f"walk {out_dir.joinpath(*parts)}: {exc.strerror or exc}")
            continue
        try:
            for entry in safefs.fd_dir(dfd):
                # d_type first (no system call): a name is stat'ed only when it is a directory
                # or matches a pattern, as on a 10^6-file tree most names do not.
                is_dir = entry.is_dir(follow_symlinks=False)
                if not is_dir:
                    scanned += 1
                    if not _matches(entry.name, patterns):
                        continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if is_dir:
                    if (st.st_dev, st.st_ino) == skip_ident:
                        continue  # the quarantine, inside the tree
                    if len(parts) + 1 > max_depth:
                        skipped.append(Skipped(str(out_dir.joinpath(*parts, entry.name)),
                                               f"deeper than max_depth={max_depth}: not walked"))
                        continue
                    stack.append((*parts, entry.name))
                    continue
                if not _stat.S_ISREG(st.st_mode):
                    continue  # symlinks, FIFOs, devices: not outputs the job wrote
                if since_wall is None or st.st_mtime >= since_wall:
                    found[(*parts, entry.name)] = _Found(st.st_mtime, (st.st_dev, st.st_ino))
        except OSError as exc:
            errors.append(f"walk {out_dir.joinpath(*parts)}: {exc.strerror or exc}")
        finally:
            os.close(dfd)
    return scanned, found


def _rel_parts(path: str | os.PathLike[str], out_dir: Path) -> tuple[str, ...] | None:
    """path's components below out_dir, lexically (never resolved), or None when outside."""
    rel = os.path.relpath(os.path.normpath(os.path.abspath(path)), os.path.normpath(out_dir))
    if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
        return None
    return tuple(rel.split(os.sep))


def validate_outputs(
    outputs_dir: str | os.PathLike[str],
    since_wall: float | None,
    quarantine_dir: str | os.PathLike[str],
    *,
    patterns: Collection[str] = DEFAULT_PATTERNS,
    max_files: int = 10_000,
    max_depth: int = 64,
    open_paths: Collection[str | os.PathLike[str]] = (),
    candidates: Iterable[str | os.PathLike[str]] = (),
    dry_run: bool = False,
    budget_s: float | None = None,
    clock: Clock = SYSTEM_CLOCK,
    check: Callable[[Path], FileCheck] | None = None,
    crc_max_bytes: int | None = CRC_MAX_BYTES,
    use_torch: bool | None = None,
) -> ValidationReport:
    """Check the outputs written at or after `since_wall` (mtime; None: all) and move the broken
    ones to `quarantine_dir`, keeping their path relative to `outputs_dir`.

    This blocks on the outputs filesystem: run it in a worker with a deadline, after the kill is
    `done`, never on the daemon's tick. It walks the whole tree (one stat per name) but
    validates only recent files, newest first, at most `max_files` of them and within
    `budget_s`; `candidates` (e.g. the files the job had open for writing when it was killed)
    are checked first, whatever their age. Files in `open_paths` (open for writing by a live process)
    are skipped: moving a file under its writer helps nobody. A quarantine folder inside the
    outputs tree is left out of the walk. Anything skipped makes the report not
    `safe_to_resume`. Each file is validated through the fd it was opened by
    (/proc/self/fd/N), so what is checked is what is moved.
    """
    t0 = clock.monotonic()
    out_dir = Path(os.path.normpath(os.path.abspath(outputs_dir)))
    qdir = Path(quarantine_dir)
    errors: list[str] = []
    notes: list[str] = []
    skipped: list[Skipped] = []
    quarantined: list[Quarantined] = []

    def report(scanned: int = 0, checked: int = 0, valid: int = 0) -> ValidationReport:
        return ValidationReport(
            outputs_dir=str(out_dir), quarantine_dir=str(qdir), since_wall=since_wall,
            dry_run=dry_run, scanned=scanned, checked=checked, valid=valid,
            quarantined=tuple(quarantined), skipped=tuple(skipped), errors=tuple(errors),
            notes=tuple(notes), duration_s=clock.monotonic() - t0)

    try:
        out_fd = safefs.open_dir(out_dir)
    except FileNotFoundError:
        notes.append(f"{out_dir} does not exist: nothing was written, nothing to check")
        return report()
    except OSError as exc:
        errors.append(f"outputs: {exc}")
        return report()
    q_fd: int | None = None
    try:
        try:
            q_fd = safefs.open_dir(qdir, create=not dry_run)
            qst = os.fstat(q_fd)
            q_ident: tuple[int, int] | None = (qst.st_dev, qst.st_ino)
        except FileNotFoundError:
            q_ident = None  # a dry run creates nothing
        except OSError as exc:
            errors.append(f"quarantine: {exc}")
            return report()
        scanned, found = _walk(out_fd, out_dir, patterns, since_wall, q_ident, max_depth,
                               errors, skipped)
        named: set[tuple[str, ...]] = set()
        for c in candidates:
            parts = _rel_parts(c, out_dir)
            if parts is None:
                skipped.append(Skipped(str(c), "outside the outputs directory: not touched"))
                continue
            named.add(parts)
            if parts in found:
                continue
            try:
                pfd = safefs.open_rel(out_fd, parts[:-1])
                try:
                    st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
                finally:
                    os.close(pfd)
            except FileNotFoundError:
                continue  # never written: the resume writes it
            except OSError as exc:
                errors.append(f"stat {c}: {exc.strerror or exc}")
                continue
            if _stat.S_ISREG(st.st_mode):
                found[parts] = _Found(st.st_mtime, (st.st_dev, st.st_ino))

        writing = {p for p in (_rel_parts(o, out_dir) for o in open_paths) if p is not None}
        # The candidates first (the likeliest broken: the job had them open for writing), then
        # newest first: on a loaded host the budget ran out after one file of 50, and a torchrun
        # rank's half-written file, older than the other ranks' last ones, was left in place.
        order = sorted(found, key=lambda p: (p not in named, -found[p].mtime, p))
        checked = valid = 0
        for i, parts in enumerate(order):
            path = str(out_dir.joinpath(*parts))
            if i >= max_files:
                skipped.extend(Skipped(str(out_dir.joinpath(*p)), f"over max_files={max_files}")
                               for p in order[i:])
                break
            if budget_s is not None and clock.monotonic() - t0 > budget_s:
                skipped.extend(Skipped(str(out_dir.joinpath(*p)),
                                       f"over the time budget of {budget_s:g} s")
                               for p in order[i:])
                break
            if parts in writing:
                skipped.append(Skipped(path, "open for writing by a live process"))
                continue
            ok = _check_one(out_fd, parts, found[parts].ident, path, q_fd, qdir, check, dry_run,
                            crc_max_bytes, use_torch, clock, errors, notes, quarantined)
            if ok is None:
                continue
            checked += 1
            valid += ok
        return report(scanned, checked, valid)
    finally:
        os.close(out_fd)
        if q_fd is not None:
            os.close(q_fd)


def _check_one(out_fd: int, parts: tuple[str, ...], ident: tuple[int, int], path: str,
               q_fd: int | None, qdir: Path, check: Callable[[Path], FileCheck] | None,
               dry_run: bool, crc_max_bytes: int | None, use_torch: bool | None, clock: Clock,
               errors: list[str], notes: list[str], quarantined: list[Quarantined]) -> bool | None:
    """Validate one file through its fd; move it when broken. True/False: valid or not; None:
    not checked (gone, or no longer the file the walk saw)."""
    try:
        pfd = safefs.open_rel(out_fd, parts[:-1])
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror or exc}")
        return None
    try:
        try:
            fd = safefs.open_in(pfd, parts[-1], where=path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            errors.append(f"{path}: not checked: {exc.strerror or exc}")
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ident:
                errors.append(f"{path}: replaced during the validation: not checked")
                return None
            via = Path(self_fd_path(fd))
            try:
                if check is not None:
                    ok, reason = check(via)
                else:
                    ok, reason = validate_file(via, crc_max_bytes=crc_max_bytes,
                                               use_torch=use_torch, name=parts[-1])
            except Exception as exc:  # noqa: BLE001 - a checker bug must not stop the others
                ok, reason = False, f"check failed: {type(exc).__name__}"
            if ok:
                return True
            dst = qdir.joinpath(*parts)
            if dry_run:
                quarantined.append(Quarantined(path, str(dst), reason))
                return False
            assert q_fd is not None  # opened above unless dry_run
            try:
                qpfd = safefs.open_rel(q_fd, parts[:-1], create=True)
                try:
                    moved = move_at(pfd, parts[-1], fd, qpfd, parts[-1])
                finally:
                    os.close(qpfd)
                dst = dst.parent / moved
            except OSError as exc:
                if exc.errno not in QUARANTINE_FULL:
                    errors.append(f"{path} is broken ({reason}) but could not be quarantined: "
                                  f"{exc.strerror or exc}")
                    return False
                # The quarantine's filesystem (the state directory's) is full or read-only:
                # the broken file is renamed aside in its own directory instead, relative to
                # the same fd (a hard link to a free name, then the old name unlinked: never
                # replacing a name, never following one). Giving up here would stop a job
                # over a full /var; leaving the file would make the resume skip it forever.
                try:
                    moved = move_at(pfd, parts[-1], fd, pfd, parts[-1] + ASIDE_SUFFIX)
                except OSError as exc2:
                    errors.append(f"{path} is broken ({reason}) but could not be quarantined "
                                  f"({exc.strerror or exc}) nor renamed aside: "
                                  f"{exc2.strerror or exc2}")
                    return False
                dst = Path(path).parent / moved
                reason = (f"{reason}; renamed aside in place: the quarantine could not take it "
                          f"({exc.strerror or exc})")
            quarantined.append(Quarantined(path, str(dst), reason))
            _manifest(q_fd, parts, path, dst, reason, clock, notes)
            return False
        finally:
            os.close(fd)
    finally:
        os.close(pfd)


def _manifest(q_fd: int, parts: tuple[str, ...], src: str, dst: Path, reason: str,
              clock: Clock, notes: list[str]) -> None:
    """One JSON line per moved file, in the quarantine (root's), so a person finds out later
    why it is there. Names are data: JSON strings, every non-ASCII or undecodable byte escaped
    (`\\udcXX` for a byte that is not UTF-8), never text a shell could read."""
    line = json.dumps({"at": clock.time(), "src": src, "dst": str(dst),
                       "relative": list(parts), "reason": reason}, ensure_ascii=True) + "\n"
    try:
        fd = safefs.open_in(q_fd, MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:
        notes.append(f"manifest not written for {dst}: {exc.strerror or exc}")
