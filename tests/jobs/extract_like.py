#!/usr/bin/env python3
"""An extraction-like job: the shape of SpecForge's `prepare_hidden_states.py`, without a GPU.

For each sample it (optionally) asks an inference server for hidden states, then writes one output
file, `OUT/rows_{g}-{g+2000}/data_{idx}.pt`, straight to its final path (no temp file and rename,
as SpecForge does), in the zip layout `torch.save` uses. Progress is a tqdm-style bar on stderr,
redrawn with `\\r`:

    Generating Hidden States:  49%|████▉     | 18380/37312 [04:58<05:07,  1.03it/s, processed=18380, skipped=0]

Run again with the same arguments and it resumes: samples whose output exists are skipped.

Fault switches, so stallwatch's tests can put it in real trouble (each happens when N samples are
done, right after the progress line that says N):

    --deadlock-at N    two threads take two locks in opposite order: every thread asleep (S)
    --spin-at N        busy-waits on a flag nobody sets: one thread running (R), no progress
    --crash-at N       raises an exception: a traceback in the log, exit code 1
    --oom-at N         keeps allocating memory until the kernel kills it (run it in a memory cgroup)
    --checkpoint-every N --checkpoint-s S
                       every N samples, writes a big checkpoint file for S seconds: I/O moves but no
                       progress line is printed. Healthy, not a stall.

Standard library only, so it runs anywhere:

    python extract_like.py --out /tmp/hs --n 200 --sample-s 0.1 --log /tmp/hs.log
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import threading
import time
import urllib.request
import zipfile

DESC = "Generating Hidden States"
ROWS_PER_DIR = 2000


# --- a hand-written tqdm bar ----------------------------------------------------------------------


def _clock(seconds: float) -> str:
    """tqdm's elapsed/remaining format: MM:SS, or H:MM:SS past an hour."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Bar:
    """Just enough of tqdm: `desc:  pct%|bar| n/total [elapsed<remaining, rate, postfix]`."""

    BLOCKS = " ▏▎▍▌▋▊▉█"
    WIDTH = 10

    def __init__(self, total: int, desc: str, stream=sys.stderr) -> None:
        self.total, self.desc, self.stream = total, desc, stream
        self.n = 0
        self.postfix = ""
        self.start = time.monotonic()
        self._rate: float | None = None  # smoothed, like tqdm's EMA
        self._last = (self.start, 0)
        self.draw()

    def update(self, k: int = 1, **postfix: object) -> None:
        now = time.monotonic()
        self.n += k
        t0, n0 = self._last
        if now > t0:
            inst = (self.n - n0) / (now - t0)
            self._rate = inst if self._rate is None else 0.3 * inst + 0.7 * self._rate
        self._last = (now, self.n)
        if postfix:
            self.postfix = ", ".join(f"{key}={value}" for key, value in postfix.items())
        self.draw()

    def render(self) -> str:
        frac = self.n / self.total if self.total else 0.0
        eighths = int(frac * self.WIDTH * 8)
        full, part = divmod(eighths, 8)
        bar = "█" * full + (self.BLOCKS[part] if full < self.WIDTH else "")
        bar = bar.ljust(self.WIDTH)
        elapsed = time.monotonic() - self.start
        if self._rate:
            remaining = _clock((self.total - self.n) / self._rate)
            rate = f"{self._rate:5.2f}it/s" if self._rate >= 1 else f"{1 / self._rate:5.2f}s/it"
        else:
            remaining, rate = "?", "?it/s"
        tail = f", {self.postfix}" if self.postfix else ""
        return (f"{self.desc}: {frac * 100:3.0f}%|{bar}| {self.n}/{self.total} "
                f"[{_clock(elapsed)}<{remaining}, {rate}{tail}]")

    def draw(self) -> None:
        self.stream.write("\r" + self.render())
        self.stream.flush()

    def write(self, message: str) -> None:
        """A message on its own line, the bar redrawn below it (tqdm.write)."""
        self.stream.write("\r" + message + "\n")
        self.draw()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


# --- the work -------------------------------------------------------------------------------------


def output_path(out: str, idx: int) -> str:
    g = idx // ROWS_PER_DIR * ROWS_PER_DIR
    return os.path.join(out, f"rows_{g}-{g + ROWS_PER_DIR}", f"data_{idx}.pt")


def ask_server(server: str, idx: int) -> list:
    """POST /generate as SGLang takes it; no timeout, like most clients in the wild."""
    body = json.dumps({
        "input_ids": [idx % 32000, 1, 2, 3],
        "sampling_params": {"max_new_tokens": 1},
        "return_hidden_states": True,
    }).encode()
    req = urllib.request.Request(server.rstrip("/") + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:  # blocks in recvfrom until the server answers
        return json.loads(resp.read())["meta_info"]["hidden_states"]


_made_dirs: set[str] = set()


def save_sample(path: str, idx: int, hidden: list, nbytes: int) -> None:
    """A zip archive laid out like torch.save's, written in place."""
    folder = os.path.dirname(path)
    if folder not in _made_dirs:  # once per rows_ folder, not once per sample
        os.makedirs(folder, exist_ok=True)
        _made_dirs.add(folder)
    stem = os.path.splitext(os.path.basename(path))[0]
    record = {"input_ids": [idx % 32000, 1, 2, 3], "loss_mask": [0, 1, 1, 1],
              "hidden_state": hidden, "aux_hidden_state": None}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{stem}/data.pkl", pickle.dumps(record, protocol=2))
        z.writestr(f"{stem}/byteorder", "little")
        z.writestr(f"{stem}/data/0", os.urandom(nbytes))
        z.writestr(f"{stem}/version", "3\n")


def save_checkpoint(path: str, seconds: float, bar: Bar, chunk: int = 1 << 20,
                    cap: int = 64 << 20) -> None:
    """Write a big file for `seconds`: the I/O counters move, the progress bar does not."""
    bar.write(f"saving checkpoint to {path}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    block = os.urandom(chunk)
    t_end = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < t_end:
            f.write(block)
            if f.tell() >= cap:  # a real checkpoint is bigger; wrap so the disk is not filled
                f.flush()
                os.fsync(f.fileno())
                f.seek(0)
            time.sleep(0.1)
        f.flush()
        os.fsync(f.fileno())
    bar.write(f"checkpoint saved ({seconds:g} s)")


# --- the faults -----------------------------------------------------------------------------------


def deadlock() -> None:
    """The writer and the prefetcher each hold one lock and want the other's: forever."""
    index_lock, buffer_lock = threading.Lock(), threading.Lock()
    both_held = threading.Barrier(2)

    def work(first: threading.Lock, second: threading.Lock) -> None:
        with first:
            both_held.wait()
            with second:
                pass

    threads = [threading.Thread(target=work, args=(index_lock, buffer_lock), name="writer"),
               threading.Thread(target=work, args=(buffer_lock, index_lock), name="prefetcher")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def spin() -> None:
    """Busy-wait on a flag that no one will ever set (a livelock as seen from outside)."""
    ready = False
    while not ready:
        pass


def crash() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def eat_memory() -> None:
    """Hold ever more memory, touched so it really counts, until the kernel kills us."""
    hoard = []
    while True:
        hoard.append(b"\x01" * (16 << 20))


# --- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="outputs directory")
    ap.add_argument("--n", type=int, default=1000, help="number of samples")
    ap.add_argument("--shard", type=int, default=0, help="this node's share: samples i with "
                    "i %% of == shard (one shard per Slurm node, deploy/slurm/extract.sbatch)")
    ap.add_argument("--of", type=int, default=1, help="number of shards")
    ap.add_argument("--sample-s", type=float, default=0.2, help="seconds of work per sample")
    ap.add_argument("--sample-bytes", type=int, default=64 << 10, help="payload bytes per output")
    ap.add_argument("--server", help="inference server URL: POST /generate for every sample")
    ap.add_argument("--log", help="append stderr (progress, tracebacks) to this file")
    ap.add_argument("--deadlock-at", type=int, metavar="N")
    ap.add_argument("--spin-at", type=int, metavar="N")
    ap.add_argument("--crash-at", type=int, metavar="N")
    ap.add_argument("--oom-at", type=int, metavar="N")
    ap.add_argument("--checkpoint-every", type=int, metavar="N")
    ap.add_argument("--checkpoint-s", type=float, default=30.0, metavar="S")
    ap.add_argument("--checkpoint-dir", help="default: OUT/../checkpoints")
    a = ap.parse_args(argv)

    if a.log:
        # Like `2>>log`: the bar, messages and an uncaught exception's traceback all go there.
        fd = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    ckpt_dir = a.checkpoint_dir or os.path.join(os.path.dirname(os.path.abspath(a.out)), "checkpoints")
    faults = [(a.deadlock_at, deadlock), (a.spin_at, spin), (a.oom_at, eat_memory),
              (a.crash_at, crash)]

    print(f"loaded {a.n} samples; writing to {a.out}", file=sys.stderr, flush=True)
    if not 0 <= a.shard < a.of:
        ap.error(f"--shard {a.shard} is not in 0..{a.of - 1}")
    mine = range(a.shard, a.n, a.of)
    bar = Bar(len(mine), DESC)
    processed = skipped = 0
    try:
        for done, idx in enumerate(mine):  # done: samples finished so far, what the bar shows
            for at, fault in faults:
                if at == done:
                    fault()
            if a.checkpoint_every and done and done % a.checkpoint_every == 0:
                save_checkpoint(os.path.join(ckpt_dir, "state.bin"), a.checkpoint_s, bar)
            path = output_path(a.out, idx)
            if os.path.exists(path):  # resume: an existing file counts as done, as in SpecForge
                skipped += 1
                bar.update(1, processed=processed, skipped=skipped)
                continue
            t0 = time.monotonic()
            hidden = ask_server(a.server, idx) if a.server else [[0.0] * 8]
            time.sleep(max(0.0, a.sample_s - (time.monotonic() - t0)))  # the "GPU" work
            save_sample(path, idx, hidden, a.sample_bytes)
            processed += 1
            bar.update(1, processed=processed, skipped=skipped)
    finally:
        bar.close()  # what `with tqdm(...)` does, also on an exception
    print(f"done: {processed} processed, {skipped} skipped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
