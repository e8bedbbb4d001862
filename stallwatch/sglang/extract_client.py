"""A reference hidden-states extraction client, shaped like SpecForge's prepare_hidden_states.py.

    python -m stallwatch.sglang.extract_client --server http://127.0.0.1:30000 --out DIR \\
        --num-samples N [--seq-len T] [--batch B] [--concurrency C] [--resume] [--log FILE]

For each sample it POSTs /generate with `return_hidden_states` (max_new_tokens 1, so the
answer is the prefill's hidden states, one element per prefill chunk), and saves
`{input_ids, loss_mask, hidden_state}` with torch.save's format to
`{out}/rows_{g}-{g+2000}/data_{idx}.ckpt` — straight to the final path, as SpecForge does
(`--atomic` writes a temporary file and renames it: the fix). `--resume` skips files that exist
(so, like SpecForge, a truncated file left by a killed run counts as done; `--verify-existing`
checks them instead). Progress is a tqdm bar `Generating Hidden States` on stderr with postfix
`processed=…, skipped=…, pending_io=…` (tqdm when installed, else the same format by hand).
Writes run in a background thread (`--io-workers`), at most `--max-pending-io` queued.

Errors exit non-zero: an HTTP error, a timeout (`--timeout-s`, long by default as in real
clients: a hung server leaves the client waiting in recv), a write error (unlike SpecForge,
whose background write errors can be lost). Fault hooks: `--fault-at N --fault hang|crash|io`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from stallwatch.sglang import ptfile

GROUP_SIZE = 2000
DESC = "Generating Hidden States"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stallwatch.sglang.extract_client",
                                description="Extract hidden states from an SGLang(-protocol) server "
                                            "into one torch.save file per sample (a template).")
    a = p.add_argument
    a("--server", required=True, help="base URL, e.g. http://127.0.0.1:30000")
    a("--out", required=True, help="output folder")
    a("--num-samples", type=int, required=True)
    a("--start", type=int, default=0, help="first sample index")
    a("--seq-len", type=int, default=64, help="tokens per sample")
    a("--vocab-size", type=int, default=1000, help="synthetic token ids are below this")
    a("--seed", type=int, default=0)
    a("--batch", type=int, default=1, help="samples per /generate request")
    a("--concurrency", type=int, default=1, help="requests in flight")
    a("--resume", action="store_true", help="skip samples whose file exists")
    a("--verify-existing", action="store_true",
      help="with --resume: redo existing files that are not whole archives (not SpecForge's behaviour)")
    a("--atomic", action="store_true", help="write a temporary file, fsync, rename (the safe way)")
    # Upstream SGLang has only return_hidden_states -> meta_info["hidden_states"] (an EAGLE-3
    # target returns its captured layers' concatenation there): nothing else is asked for.
    a("--no-aux", action="store_true", help=argparse.SUPPRESS)  # accepted for old command lines
    a("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    a("--io-workers", type=int, default=1, help="background writer threads (0: write inline)")
    a("--max-pending-io", type=int, default=4, help="queued writes before generation waits")
    a("--timeout-s", type=float, default=600.0, help="per request socket timeout")
    a("--retry-s", type=float, default=0.0,
      help="retry a request whose connection failed (refused, reset) for this long, as clients "
           "with retrying HTTP sessions do; 0: fail at once")
    a("--log", default=None, help="also append progress and messages to this file")
    a("--fault", choices=["hang", "crash", "io", "hang_mid_write"], default=None,
      help="hang: deadlock; crash: raise; io: write that sample to --io-path; hang_mid_write: "
           "the writer deadlocks half-way through that sample's file (a truncated file is left "
           "at its final path, as a killed SpecForge job leaves one)")
    a("--fault-at", type=int, default=None, help="sample index where the fault happens")
    a("--io-path", default=None, help="for --fault io: a file or folder (e.g. on a frozen fs)")
    a("--fault-always", action="store_true",
      help="fire the fault on every run (default: once per output folder, so a resume completes)")
    return p


# --------------------------------------------------------------------------------- output


class Tee:
    """A text stream writing to stderr and, optionally, a log file (progress included)."""

    def __init__(self, stream: TextIO, log_path: str | None) -> None:
        self.stream = stream
        self.log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115 - held for the Tee's life, closed by close()
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self.stream.write(s)
            if self.log is not None:
                self.log.write(s)
        return len(s)

    def flush(self) -> None:
        with self._lock:
            self.stream.flush()
            if self.log is not None:
                self.log.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # tqdm draws the unicode bar only when it can see an encoding
        return getattr(self.stream, "encoding", None) or "utf-8"

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def format_interval(t: float) -> str:
    mins, s = divmod(int(t), 60)
    h, m = divmod(mins, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def format_num(n: Any) -> str:
    """tqdm's format_num: the shorter of 3 significant digits and the plain value."""
    f = f"{n:.3g}".replace("e+0", "e+").replace("e-0", "e-")
    n = str(n)
    return f if len(f) < len(n) else n


def format_meter(n: int, total: int, elapsed: float, rate: float | None, prefix: str, postfix: str) -> str:
    """tqdm.format_meter for the default bar on a non-terminal (10-character bar)."""
    frac = n / total if total else 0.0
    pct = frac * 100
    syms = " ▏▎▍▌▋▊▉█"
    full, part = divmod(int(frac * 10 * 8), 8)
    bar = syms[-1] * full
    if full < 10:
        bar += syms[part] + " " * (10 - full - 1)
    remaining = (total - n) / rate if rate and total else None
    rem = format_interval(remaining) if remaining is not None else "?"
    if rate:
        inv = 1 / rate
        rate_fmt = f"{inv:5.2f}s/it" if inv > 1 else f"{rate:5.2f}it/s"
    else:
        rate_fmt = "?it/s"
    post = f", {postfix}" if postfix else ""
    return (f"{prefix}: {pct:3.0f}%|{bar}| {n}/{total} [{format_interval(elapsed)}<{rem}, "
            f"{rate_fmt}{post}]")


class HandBar:
    """What tqdm prints (\\r-updated, at most every 0.1 s, EMA-smoothed rate), without tqdm."""

    def __init__(self, total: int, desc: str, file: Any, mininterval: float = 0.1) -> None:
        self.total, self.desc, self.file = total, desc, file
        self.n = 0
        self.mininterval = mininterval
        self.start = self.last_print_t = time.monotonic()
        self.last_print_n = 0
        self._ema_dn = self._ema_dt = 0.0
        self._calls = 0
        self.postfix = ""
        self._last_len = 0
        self._display()

    def _rate(self) -> float | None:
        if not self._calls:
            return None
        corr = 1 - (1 - 0.3) ** self._calls
        dn, dt = self._ema_dn / corr, self._ema_dt / corr
        return dn / dt if dt else None

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if now - self.last_print_t >= self.mininterval:
            dn, dt = self.n - self.last_print_n, now - self.last_print_t
            self._ema_dn = 0.3 * dn + 0.7 * self._ema_dn
            self._ema_dt = 0.3 * dt + 0.7 * self._ema_dt
            self._calls += 1
            self.last_print_n, self.last_print_t = self.n, now
            self._display()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kw: Any) -> None:
        """tqdm's signature and order: the ordered dict's keys first, then kwargs sorted."""
        items = dict(ordered_dict or {})
        items.update((k, kw[k]) for k in sorted(kw))
        self.postfix = ", ".join(f"{k}={format_num(v) if isinstance(v, (int, float)) else str(v).strip()}"
                                 for k, v in items.items())
        if refresh:  # as tqdm: a refresh prints now, whatever mininterval says
            self._display()

    def _display(self) -> None:
        s = format_meter(self.n, self.total, time.monotonic() - self.start, self._rate(), self.desc,
                         self.postfix)
        self.file.write("\r" + s + " " * max(self._last_len - len(s), 0))
        self.file.flush()
        self._last_len = len(s)

    def close(self) -> None:
        self._display()
        self.file.write("\n")
        self.file.flush()


def make_bar(total: int, file: Any, use_tqdm: bool | None = None) -> Any:
    if use_tqdm is not False:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=DESC, file=file)
        except ImportError:
            if use_tqdm:
                raise
    return HandBar(total, DESC, file)


# ----------------------------------------------------------------------------------- data


def sample_path(out: Path, idx: int) -> Path:
    g = (idx // GROUP_SIZE) * GROUP_SIZE
    return out / f"rows_{g}-{g + GROUP_SIZE}" / f"data_{idx}.ckpt"


def make_sample(idx: int, seq_len: int, vocab: int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic synthetic data: token ids, and a loss mask off for the first quarter (the
    prompt) and on for the rest (the response), as in chat-formatted training data."""
    rng = random.Random(seed * 1_000_003 + idx)
    ids = [rng.randrange(vocab) for _ in range(seq_len)]
    prompt = seq_len // 4
    return ids, [0] * prompt + [1] * (seq_len - prompt)


class Generator:
    """One HTTP connection per thread; POST /generate with a long timeout."""

    def __init__(self, server: str, timeout_s: float, retry_s: float = 0.0) -> None:
        u = urlsplit(server if "//" in server else f"http://{server}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return c

    def generate(self, batch: list[list[int]]) -> list[dict]:
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return self._generate(batch)
            except ConnectionError:  # refused, reset, closed without an answer
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def _generate(self, batch: list[list[int]]) -> list[dict]:
        body = {"input_ids": batch, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_hidden_states": True}
        data = json.dumps(body).encode()
        conn = self._conn()
        try:
            conn.request("POST", self.prefix + "/generate", body=data,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        except TimeoutError:
            self._local.conn = None
            conn.close()
            raise TimeoutError(f"POST {self.prefix}/generate to {self.host}:{self.port} did not answer "
                               f"within {self.timeout_s:g} s") from None
        except (OSError, http.client.HTTPException):
            self._local.conn = None
            conn.close()
            raise
        if resp.status != 200:
            raise RuntimeError(f"POST /generate: HTTP {resp.status}: {raw[:500].decode('utf-8', 'replace')}")
        out = json.loads(raw)
        return out if isinstance(out, list) else [out]


def _rows(elements: list, seq_len: int, what: str) -> list:
    """Concatenate the prefill chunks ([t][H] each) into [T][H]; decode elements (1-D) follow
    them when max_new_tokens > 1 and are not part of the prompt's hidden states."""
    rows: list = []
    for el in elements:
        if el and isinstance(el[0], list):
            rows.extend(el)
    if len(rows) != seq_len:
        raise RuntimeError(f"server returned {len(rows)} {what} rows for {seq_len} input tokens")
    return rows


def _has_nan(rows: list) -> bool:
    return any(math.isnan(x) for row in rows for x in row)


def build_record(ids: list[int], mask: list[int], meta: dict, dtype: str, use_torch: bool) -> dict:
    hidden = _rows(meta.get("hidden_states") or [], len(ids), "hidden_states")
    if _has_nan(hidden):
        raise ValueError("NaN in hidden states")
    if use_torch:
        import torch

        dt = getattr(torch, dtype)
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long),
                "hidden_state": torch.tensor(hidden, dtype=dt).unsqueeze(0)}
    return {"input_ids": ptfile.Tensor.from_list(ids, "int64"), "loss_mask": ptfile.Tensor.from_list(mask, "int64"),
            "hidden_state": ptfile.Tensor.from_list([hidden], dtype)}


# ------------------------------------------------------------------------------------ run


class Extraction:
    def __init__(self, args: argparse.Namespace, err: Any) -> None:
        self.a = args
        self.err = err
        self.out = Path(args.out)
        self.use_torch = ptfile.torch_available()
        self.gen = Generator(args.server, args.timeout_s, args.retry_s)
        self.processed = self.skipped = 0
        self.io_futures: deque[Future] = deque()
        self.io_pool = ThreadPoolExecutor(args.io_workers, thread_name_prefix="save") if args.io_workers > 0 else None
        self.req_pool = ThreadPoolExecutor(max(1, args.concurrency), thread_name_prefix="request")
        self.bar: Any = None
        self._fault_marker = self.out / ".stallwatch-fault-fired"

    # -- faults ---------------------------------------------------------------------------------

    def _fault_due(self, idx: int) -> bool:
        a = self.a
        if a.fault is None or a.fault_at is None or idx != a.fault_at:
            return False
        if not a.fault_always:
            if self._fault_marker.exists():
                return False
            self._fault_marker.write_text(f"{a.fault} at sample {idx}, pid {os.getpid()}\n")
        return True

    def _fire(self, idx: int) -> None:
        if self.a.fault == "hang":
            self._fire_hang()
        if self.a.fault == "crash":
            raise RuntimeError(f"injected fault: crash at sample {idx}")

    # -- saving ---------------------------------------------------------------------------------

    def _save(self, rec: dict, path: Path, torn: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not torn:
            ptfile.save(rec, path, atomic=self.a.atomic)
            return
        # The fault: half of the file reaches its final path, then the writer never returns.
        whole = path.with_name(f".{path.name}.whole")
        ptfile.save(rec, whole, atomic=False)
        data = whole.read_bytes()
        whole.unlink()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        self._fire_hang()

    def _fire_hang(self) -> None:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # a deadlock: blocked in futex forever, no wakeups

    def _pending_io(self) -> int:
        return sum(1 for f in self.io_futures if not f.done())

    def _reap_io(self, block_until: int) -> None:
        """Raise any write error; wait while more than `block_until` writes are pending."""
        while self.io_futures and (self.io_futures[0].done() or len(self.io_futures) > block_until):
            self.io_futures.popleft().result()  # re-raises the write's exception

    def _submit_write(self, rec: dict, path: Path, torn: bool = False) -> None:
        if self.io_pool is None:
            self._save(rec, path, torn)
            return
        self._reap_io(max(0, self.a.max_pending_io - 1))
        self.io_futures.append(self.io_pool.submit(self._save, rec, path, torn))

    def _postfix(self) -> None:
        self.bar.set_postfix(OrderedDict(processed=self.processed, skipped=self.skipped,
                                         pending_io=self._pending_io()))

    def _advance(self) -> None:
        self.bar.update(1)
        self._postfix()

    # -- main loop ------------------------------------------------------------------------------

    def _exists(self, path: Path) -> bool:
        if not path.exists():
            return False
        if self.a.verify_existing:
            reason = ptfile.check(path)
            if reason is not None:
                print(f"\nredoing {path}: {reason}", file=self.err)
                return False
        return True

    def _harvest(self, fut: Future, batch: list[tuple[int, list[int], list[int]]]) -> None:
        results = fut.result()
        if len(results) != len(batch):
            raise RuntimeError(f"server answered {len(results)} results for a batch of {len(batch)}")
        for (idx, ids, mask), res in zip(batch, results, strict=True):
            meta = res.get("meta_info") or {}
            try:
                rec = build_record(ids, mask, meta, self.a.dtype, self.use_torch)
            except ValueError as e:  # NaN: skipped, as SpecForge does (leaves a gap)
                print(f"\nsample {idx}: {e}; skipped", file=self.err)
                self.skipped += 1
                self._advance()
                continue
            path = sample_path(self.out, idx)
            torn = False
            if self.a.fault == "io" and self._fault_due(idx):
                path = self._io_fault_path(idx)
            elif self.a.fault == "hang_mid_write" and self._fault_due(idx):
                torn = True
            self._submit_write(rec, path, torn)
            self.processed += 1
            self._advance()

    def _io_fault_path(self, idx: int) -> Path:
        if not self.a.io_path:
            raise SystemExit("--fault io needs --io-path")
        p = Path(self.a.io_path)
        return p / f"data_{idx}.ckpt" if p.is_dir() else p

    def run(self) -> int:
        a = self.a
        self.out.mkdir(parents=True, exist_ok=True)
        indices = range(a.start, a.start + a.num_samples)
        print(f"Extracting {a.num_samples} samples from {a.server} into {self.out} "
              f"(seq_len={a.seq_len}, batch={a.batch}, concurrency={a.concurrency}, "
              f"writer={'torch.save' if self.use_torch else 'stallwatch.sglang.ptfile'}, "
              f"{'atomic' if a.atomic else 'non-atomic'} writes)", file=self.err, flush=True)
        self.bar = make_bar(a.num_samples, self.err)
        self._postfix()
        inflight: deque[tuple[Future, list]] = deque()
        batch: list[tuple[int, list[int], list[int]]] = []

        def flush_batch() -> None:
            if batch:
                fut = self.req_pool.submit(self.gen.generate, [ids for _, ids, _ in batch])
                inflight.append((fut, list(batch)))
                batch.clear()

        try:
            for idx in indices:
                if a.resume and self._exists(sample_path(self.out, idx)):
                    self.skipped += 1
                    self._advance()
                    continue
                if a.fault in ("hang", "crash") and self._fault_due(idx):
                    flush_batch()
                    while inflight:
                        self._harvest(*inflight.popleft())
                    self._fire(idx)
                ids, mask = make_sample(idx, a.seq_len, a.vocab_size, a.seed)
                batch.append((idx, ids, mask))
                if len(batch) >= a.batch:
                    flush_batch()
                while len(inflight) >= max(1, a.concurrency):
                    self._harvest(*inflight.popleft())
                    self._reap_io(a.max_pending_io)
            flush_batch()
            while inflight:
                self._harvest(*inflight.popleft())
            while self.io_futures:
                self._postfix()
                self.io_futures.popleft().result()
            self._postfix()
        finally:
            self.bar.close()
            self.req_pool.shutdown(wait=False, cancel_futures=True)
        if self.io_pool is not None:
            self.io_pool.shutdown(wait=True)
        print(f"Done: processed={self.processed}, skipped={self.skipped}, out={self.out}",
              file=self.err, flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    """Run an extraction; returns 0, raises on errors (the traceback also goes to --log)."""
    args = build_parser().parse_args(argv)
    if args.fault is not None and args.fault_at is None:
        raise SystemExit("--fault needs --fault-at N")
    err = Tee(sys.stderr, args.log)
    ex = Extraction(args, err)
    try:
        return ex.run()
    except Exception:
        if err.log is not None:
            import traceback

            err.log.write(traceback.format_exc())  # where a watchdog reading the log finds it
        if ex.io_pool is not None:
            ex.io_pool.shutdown(wait=True)  # let queued writes finish; requests are abandoned
        raise
    finally:
        err.close()


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # noqa: BLE001 - the client's last word: the traceback, exit 1
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait for request threads still blocked on a hung server
    sys.exit(code)
