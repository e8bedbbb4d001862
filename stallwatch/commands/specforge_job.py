#!/usr/bin/env python3
"""A hidden-state extraction shaped like SpecForge's `scripts/prepare_hidden_states.py` (HEAD,
2026-08; docs/upstream.md §1-2), written from its behaviour: no upstream code.

Run it the way upstream is run, under torchrun (env:// rendezvous; `python specforge_job.py`
alone fails at `init_process_group`, as upstream does):

    torchrun --nproc_per_node 3 tests/jobs/specforge_job.py --output-path /tmp/hs \\
        --num-samples 120 --batch-size 4 --batch-s 0.2 > /tmp/hs.log 2>&1

What it shares with upstream, so that stallwatch sees the same thing:
- gloo process groups (CPU; `--device cuda` computes on the GPU and holds its memory, the
  collectives stay on gloo); ranks = dp_size x tp_size, TP groups of consecutive ranks. Every
  batch broadcasts "which files exist" from TP rank 0 inside its TP group (a collective per batch
  when `--tp-size` > 1); DP ranks meet only at the barriers after the loop. `--dist-timeout` in
  minutes, 2000 by default: a stuck collective waits ~33 hours.
- one real tqdm bar per DP rank over *batches*, `desc="Generating Hidden States"`,
  `position=dp_rank`, shown by TP rank 0 only, postfix `processed=…, skipped=…, pending_io=…`;
  after the loop `\\nGeneration loop finished. Processed: P, Skipped: S`, a barrier,
  `Waiting for all async I/O operations to complete...`, a `Finalizing Writes` bar, a barrier,
  and `rank R: All hidden states generated or job finished.` from every rank.
- outputs `rows_{g}-{g+G}/data_{idx}.ckpt` (G = `--file-group-size`, 2000), `torch.save` of a
  dict of tensors straight to the final path from a thread pool (`--num-io-threads`, default
  `os.cpu_count()`), at most `--io-queue-size` (50) pending: finished futures are pruned without
  `.result()`, the oldest is waited for when the queue is full. `--compress`: gzip-wrapped
  `torch.save` to `data_{idx}.ckpt.gz`. A sample with a NaN prints
  `Warning: NaN found in hidden_state for PATH. Skipping save.` and leaves a gap.
- resume by existence: a sample whose `.ckpt` or `.ckpt.gz` exists is skipped (a truncated file
  too: quarantine is the watchdog's job). `vocab_mapping/vocab_mapping.pt` is written atomically.

Fault hooks (`--fault KIND --fault-rank R --fault-batch B`; the fault fires once per output
folder: a marker `.specforge_job_fault_KIND_rankR` in it stops a resumed run from firing again):
    deadlock   rank R's writer thread writes half of a file, then it and the rank's main thread
               take two locks in opposite order: both asleep (S), the file half-written, the
               other ranks wait in their next collective (TP) or at the barrier (DP)
    spin       rank R's main thread busy-waits on a flag nobody sets: R at 100 % of a core
    crash      rank R raises: a traceback, exit 1; torchrun stops the other ranks and exits 1
`--nan-at IDX` puts a NaN in sample IDX (skipped with the warning, as upstream does).
A writer stuck in D is made from outside: put `--output-path` on a loop-mounted ext4 and
`fsfreeze -f` it (root); `--write-s` slows every write (a slow disk; a long write-queue drain).
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import IO, cast

import torch
import torch.distributed as dist
from tqdm import tqdm

DESC = "Generating Hidden States"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-path", required=True)
    p.add_argument("--num-samples", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--batch-s", type=float, default=0.2, help="seconds one batch's forward takes")
    p.add_argument("--write-s", type=float, default=0.0, help="extra seconds each file write takes")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--dist-timeout", type=int, default=2000, help="minutes, as upstream")
    p.add_argument("--num-io-threads", type=int, default=None)
    p.add_argument("--io-queue-size", type=int, default=50)
    p.add_argument("--file-group-size", type=int, default=2000)
    p.add_argument("--compress", action="store_true")
    p.add_argument("--compression-level", type=int, default=6)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--gpu-mem-gib", type=float, default=0.0,
                   help="with --device cuda: GPU memory each rank holds besides its weights")
    p.add_argument("--fault", choices=("deadlock", "spin", "crash"), default=None)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-batch", type=int, default=3)
    p.add_argument("--nan-at", type=int, action="append", default=[])
    return p.parse_args(argv)


def rank_print(msg: str) -> None:
    print(f"rank {dist.get_rank()}: {msg}", flush=True)


# --- the model: a stand-in for SGLang's capture (embedding and a few layers) ---------------------


class Target:
    def __init__(self, args: argparse.Namespace, device: str) -> None:
        g = torch.Generator().manual_seed(1234)
        h = args.hidden_size
        self.device = device
        self.embed = torch.randn(1024, h, generator=g).to(device)
        self.layers = [torch.randn(h, h, generator=g).div_(h ** 0.5).to(device) for _ in range(3)]
        self.reserve = None
        if device == "cuda" and args.gpu_mem_gib > 0:
            self.reserve = torch.empty(int(args.gpu_mem_gib * (1 << 30)), dtype=torch.uint8,
                                       device=device)

    def capture(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        x = self.embed[input_ids.to(self.device) % self.embed.shape[0]]
        aux = []
        for w in self.layers:
            x = torch.tanh(x @ w)
            aux.append(x)
        return list(torch.cat(aux, dim=-1)), list(x)


def sample(idx: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(idx)
    n = int(torch.randint(8, args.max_length + 1, (1,), generator=g))
    ids = torch.randint(0, 32000, (n,), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones(n, dtype=torch.long)}


# --- the writer --------------------------------------------------------------------------------


class Writer:
    """Thread-pool saves with upstream's bounded queue and its pruning without .result()."""

    def __init__(self, args: argparse.Namespace, fault_here: bool) -> None:
        self.args = args
        self.ext = ".ckpt.gz" if args.compress else ".ckpt"
        self.pool = ThreadPoolExecutor(max_workers=args.num_io_threads or os.cpu_count() or 1,
                                       thread_name_prefix="io")
        self.pending: list = []
        self.fault_here = fault_here
        # the deadlock: writer takes lock_b then lock_a, the main thread lock_a then lock_b
        self.lock_a, self.lock_b = threading.Lock(), threading.Lock()
        self.writer_holds_b, self.main_holds_a = threading.Event(), threading.Event()
        self.deadlock_path: str | None = None

    def path(self, idx: int, ext: str | None = None) -> str:
        g = idx // self.args.file_group_size * self.args.file_group_size
        return os.path.join(self.args.output_path, f"rows_{g}-{g + self.args.file_group_size}",
                            f"data_{idx}{ext or self.ext}")

    def exists(self, idx: int) -> bool:
        return any(os.path.exists(self.path(idx, e)) for e in (self.ext, ".ckpt", ".ckpt.gz"))

    def _save(self, record: dict[str, torch.Tensor], path: str) -> None:
        for name, t in record.items():
            if t.is_floating_point() and bool(torch.isnan(t).any()):
                print(f"Warning: NaN found in {name} for {path}. Skipping save.", flush=True)
                return
        if self.args.write_s:
            time.sleep(self.args.write_s)
        if path == self.deadlock_path:
            self._write_half_then_deadlock(record, path)
        if self.args.compress:
            with gzip.open(path, "wb", compresslevel=self.args.compression_level) as f:
                torch.save(record, cast(IO[bytes], f))  # a binary file; typeshed's GzipFile is no IO
        else:
            torch.save(record, path)

    def _write_half_then_deadlock(self, record: dict[str, torch.Tensor], path: str) -> None:
        buf = io.BytesIO()
        torch.save(record, buf)
        data = buf.getvalue()
        if self.args.compress:
            data = gzip.compress(data, self.args.compression_level)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            with self.lock_b:
                self.writer_holds_b.set()
                self.main_holds_a.wait()
                with self.lock_a:  # never: the main thread holds it and waits for lock_b
                    pass

    def deadlock_main(self) -> None:
        with self.lock_a:
            self.main_holds_a.set()
            self.writer_holds_b.wait()
            with self.lock_b:  # never
                pass

    def submit(self, record: dict[str, torch.Tensor], path: str) -> None:
        if len(self.pending) >= self.args.io_queue_size:
            self.pending = [f for f in self.pending if not f.done()]  # errors lost, as upstream
            if len(self.pending) >= self.args.io_queue_size:
                self.pending.pop(0).result()
        self.pending.append(self.pool.submit(self._save, record, path))

    def drain(self, show: bool) -> None:
        for fut in tqdm(self.pending, desc="Finalizing Writes", disable=not show):
            fut.result()
        self.pending.clear()
        self.pool.shutdown(wait=True)


# --- the run -----------------------------------------------------------------------------------


def fault_marker(args: argparse.Namespace) -> str:
    return os.path.join(args.output_path, f".specforge_job_fault_{args.fault}_rank{args.fault_rank}")


def write_vocab_mapping(args: argparse.Namespace) -> None:
    """Rank 0, atomically (tmp + rename), as upstream writes its one atomic file."""
    d = os.path.join(args.output_path, "vocab_mapping")
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".vocab_mapping.pt.{os.getpid()}.tmp")
    torch.save({"d2t": torch.arange(256), "t2d": torch.ones(1024, dtype=torch.bool)}, tmp)
    os.replace(tmp, os.path.join(d, "vocab_mapping.pt"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("gloo", timeout=timedelta(minutes=args.dist_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp_size
    if world % tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp-size {tp}")
    dp_size, dp_rank, tp_rank = world // tp, rank // tp, rank % tp
    tp_groups = [dist.new_group(list(range(d * tp, d * tp + tp))) for d in range(dp_size)]
    tp_group, tp_root = tp_groups[dp_rank], dp_rank * tp
    rank_print(f"bind to {device} device {os.environ.get('LOCAL_RANK', '0')}")
    rank_print(f"DP Rank {dp_rank}, TP Rank {tp_rank}, DP Size {dp_size}, TP Size {tp}")

    os.makedirs(args.output_path, exist_ok=True)
    if rank == 0:
        write_vocab_mapping(args)
        print(f"Vocabulary mapping ready at {args.output_path}/vocab_mapping/vocab_mapping.pt",
              flush=True)
    dist.barrier()

    # contiguous shards, the earlier ranks one sample more (as upstream computes start_idx)
    per, rem = divmod(args.num_samples, dp_size)
    count = per + (dp_rank < rem)
    start = dp_rank * count if dp_rank < rem else dp_rank * per + rem
    batches = [list(range(i, min(i + args.batch_size, start + count)))
               for i in range(start, start + count, args.batch_size)]
    rank_print(f"DP Rank {dp_rank} will process {count} samples, starting from index {start}")

    fault_here = (args.fault is not None and rank == args.fault_rank
                  and not os.path.exists(fault_marker(args)))
    model = Target(args, device)
    show = tp_rank == 0
    writer = Writer(args, fault_here and args.fault == "deadlock") if show else None
    if show:
        for g in range(start // args.file_group_size * args.file_group_size, start + count,
                       args.file_group_size):
            os.makedirs(os.path.join(args.output_path, f"rows_{g}-{g + args.file_group_size}"),
                        exist_ok=True)

    processed = skipped = 0
    bar = tqdm(batches, desc=DESC, position=dp_rank, leave=True, disable=not show)
    for b, idxs in enumerate(bar):
        if fault_here and b == args.fault_batch:
            with open(fault_marker(args), "w") as f:
                f.write(f"{args.fault} fired at batch {b}, pid {os.getpid()}\n")
            if args.fault == "spin":
                flag = [False]
                while not flag[0]:  # nobody sets it
                    pass
            elif args.fault == "crash":
                raise RuntimeError(f"injected crash on rank {rank} at batch {b}")
        exists = torch.tensor([writer.exists(i) for i in idxs] if writer else [False] * len(idxs))
        if tp > 1:
            dist.broadcast(exists, src=tp_root, group=tp_group)
        todo = [i for i, e in zip(idxs, exists.tolist(), strict=True) if not e]
        skipped += len(idxs) - len(todo)
        if todo:
            time.sleep(args.batch_s)  # the forward pass of a real model
            aux, last = model.capture(torch.tensor([i % 1024 for i in todo]).unsqueeze(1))
            if writer:
                for k, i in enumerate(todo):
                    rec = sample(i, args)
                    n = rec["input_ids"].shape[0]
                    rec["aux_hidden_state"] = aux[k].cpu().expand(n, -1).clone().unsqueeze(0)
                    rec["hidden_state"] = last[k].cpu().expand(n, -1).clone().unsqueeze(0)
                    if i in args.nan_at:
                        rec["hidden_state"][0, 0, 0] = float("nan")
                    path = writer.path(i)
                    if writer.fault_here and b == args.fault_batch and k == 0:
                        writer.deadlock_path = path
                    writer.submit(rec, path)
                    if writer.deadlock_path == path:
                        writer.deadlock_main()
                processed += len(todo)
        if show:
            bar.set_postfix({"processed": processed, "skipped": skipped,
                             "pending_io": len(writer.pending) if writer else 0})
    bar.close()
    if show:
        print(f"\nGeneration loop finished. Processed: {processed}, Skipped: {skipped}", flush=True)
    dist.barrier()
    if writer:
        if show:
            print("\nWaiting for all async I/O operations to complete...", flush=True)
        writer.drain(show)
    dist.barrier()
    rank_print("All hidden states generated or job finished.")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
