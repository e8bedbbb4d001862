"""A small extraction-like job for the daemon's tests: writes `.pt`-style zip files.

Like SpecForge's prepare_hidden_states.py: one file per sample, written straight to its final
path (no temp file and rename), resume by skipping files that exist (whether whole or not),
progress on stderr as a tqdm-like line. Each file is a zip archive shaped like `torch.save`'s
(`archive/data.pkl`, `archive/version`, `archive/data/0`), written a chunk at a time, so a job
stopped mid-file leaves a truncated file without its central directory.

    python pt_writer.py --out DIR --count N [--interval S] [--size BYTES]
        [--deadlock-at I] [--crash-at I] [--crash-always] [--once MARKER] [--chunks K]
        [--hold-at I --hold-until PATH]

Faults:
    --deadlock-at I   half-way through writing file I: flush, then deadlock (two threads, two
                      locks: every thread asleep in futex, no progress, no I/O)
    --crash-at I      half-way through writing file I: raise (exit 1, traceback on stderr)
    --crash-always    crash right after start, before writing anything
    --once MARKER     a fault fires only if MARKER does not exist, and creates it when it fires
                      (so the resumed job does not walk into it again)

A gate for tests that must act while the job still runs, whatever the machine's load:
    --hold-at I --hold-until PATH   before writing sample I, wait until PATH exists
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import sys
import threading
import time
import zipfile


def payload(idx: int, size: int) -> bytes:
    """The bytes of one torch.save-like zip archive for sample idx (deterministic)."""
    buf = io.BytesIO()
    data = bytes((idx * 31 + i) % 251 for i in range(size))
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"idx": idx, "n": size}, protocol=2))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/data/0", data)
    return buf.getvalue()


def deadlock() -> None:
    a, b = threading.Lock(), threading.Lock()
    met = threading.Barrier(2)

    def grab(first: threading.Lock, second: threading.Lock) -> None:
        with first:
            met.wait()
            with second:
                pass

    ts = [threading.Thread(target=grab, args=(a, b)), threading.Thread(target=grab, args=(b, a))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def fault_armed(marker: str | None) -> bool:
    if marker is None:
        return True
    if os.path.exists(marker):
        return False
    with open(marker, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds per sample")
    ap.add_argument("--size", type=int, default=4096, help="bytes of tensor data per sample")
    ap.add_argument("--chunks", type=int, default=4, help="writes per file")
    ap.add_argument("--deadlock-at", type=int, default=None)
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--crash-always", action="store_true")
    ap.add_argument("--once", default=None)
    ap.add_argument("--crash-after-s", type=float, default=None,
                    help="every run crashes this long after it starts (after real progress)")
    ap.add_argument("--hold-at", type=int, default=None)
    ap.add_argument("--hold-until", default=None)
    args = ap.parse_args()
    started = time.monotonic()

    print(f"pt_writer pid {os.getpid()} writing {args.count} samples to {args.out}",
          file=sys.stderr, flush=True)
    if args.crash_always and fault_armed(args.once):
        time.sleep(args.interval)
        raise RuntimeError("crash-always: this job always fails")
    os.makedirs(args.out, exist_ok=True)
    skipped = 0
    for i in range(args.count):
        if i == args.hold_at and args.hold_until:
            while not os.path.exists(args.hold_until):
                time.sleep(0.05)
        path = os.path.join(args.out, f"data_{i}.pt")
        if os.path.exists(path):
            skipped += 1  # resume: an existing file counts as done, whole or not (the hazard)
        else:
            data = payload(i, args.size)
            step = max(1, len(data) // max(1, args.chunks))
            with open(path, "wb") as f:
                for off in range(0, len(data), step):
                    f.write(data[off:off + step])
                    f.flush()
                    if off + step < len(data):
                        if off >= len(data) // 2 - step and i in (args.deadlock_at, args.crash_at):
                            os.fsync(f.fileno())
                            if i == args.deadlock_at and fault_armed(args.once):
                                print(f"deadlocking in the middle of {path}", file=sys.stderr,
                                      flush=True)
                                deadlock()
                            if i == args.crash_at and fault_armed(args.once):
                                raise RuntimeError(f"crash in the middle of {path}")
                        time.sleep(args.interval / (2 * args.chunks))
            time.sleep(args.interval / 2)
        if args.crash_after_s is not None and time.monotonic() - started >= args.crash_after_s:
            raise RuntimeError(f"crash-after-s: failing {args.crash_after_s} s into the run")
        pct = 100 * (i + 1) // args.count
        print(f"Generating Hidden States: {pct:3d}%| | {i + 1}/{args.count} "
              f"[00:00<00:00, {1 / max(args.interval, 1e-3):.2f}it/s, processed={i + 1 - skipped}, "
              f"skipped={skipped}]", file=sys.stderr, flush=True)
    print("done", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
