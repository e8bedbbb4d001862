"""The reference extraction client (stallwatch.sglang.extract_client) and ptfile, end to end
against a real protocol server on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from rigs import frozen_ext4, root, spawned, task_state, thread_ids, wait_until  # noqa: F401 - root is a fixture, named as a parameter

from stallwatch.probes.text.progress import clean_line, parse_progress
from stallwatch.sglang import ptfile
from stallwatch.sglang.extract_client import HandBar, format_meter, make_sample, sample_path
from stallwatch.sglang.protocol_server import launch_server as _launch

H = 16
SERVER_FLAGS = ["--hidden-size", str(H), "--num-layers", "4", "--enable-return-hidden-states",
                "--no-access-log", "--device", "python"]


def launch_server(*args, **kw):
    return _launch(*args, die_with_parent=True, **kw)  # no server outlives a killed pytest


def has(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # noqa: BLE001 - any failure to import means: not here
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with launch_server(SERVER_FLAGS, log=str(log)) as s:
        yield s


def client(server_url: str, out: Path, n: int, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server", server_url,
            "--out", str(out), "--num-samples", str(n), "--seq-len", "8", *extra]
    r = subprocess.run(argv, capture_output=True, timeout=timeout)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()  # keep tqdm's \r as written
    return r


def progress_events(text: str) -> list:
    events = []
    for line in re.split(r"[\r\n]", text):
        ev = parse_progress(clean_line(line))
        if ev is not None and ev.desc == "Generating Hidden States":
            events.append(ev)
    return events


def files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.ckpt"))


# ---------------------------------------------------------------------------------- client


def test_writes_one_valid_file_per_sample_with_tqdm_progress(server, tmp_path):
    out, log = tmp_path / "out", tmp_path / "client.log"
    r = client(server.url, out, 6, "--log", str(log))
    assert r.returncode == 0, r.stderr
    assert files(out) == [f"rows_0-2000/data_{i}.ckpt" for i in range(6)]
    for i in range(6):
        path = sample_path(out, i)
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None
            assert zf.namelist()[0] == "archive/data.pkl"
        assert ptfile.check(path) is None
        d = ptfile.load(path)
        ids, mask = make_sample(i, 8, 1000, 0)
        assert d["input_ids"].tolist() == ids and d["loss_mask"].tolist() == mask
        assert (d["hidden_state"].dtype, d["hidden_state"].shape) == ("bfloat16", (1, 8, H))
        assert "aux_hidden_state" not in d  # upstream returns hidden_states only
    for text in (r.stderr, log.read_text()):  # stderr, and the same bar in --log
        events = progress_events(text)
        assert events, text
        last = events[-1]
        assert (last.done, last.total, last.source, last.unit) == (6, 6, "tqdm", "it")
        assert last.postfix == {"processed": 6, "skipped": 0, "pending_io": 0}
        assert [e.done for e in events] == sorted(e.done for e in events)
    assert "\r" in r.stderr  # tqdm-style in-place updates


def test_works_against_sglang_0_5_4_too(tmp_path):
    """The old shape (SpecForge pinned 0.5.4): /get_* routes only, the old titles; /generate
    and its hidden states are the same, so the reference client's default needs nothing else."""
    with launch_server([*SERVER_FLAGS, "--sglang-version", "0.5.4", "--chunked-prefill-size", "3"]) as s:
        out = tmp_path / "out"
        r = client(s.url, out, 3)
        assert r.returncode == 0, r.stderr
        d = ptfile.load(sample_path(out, 2))
        assert d["hidden_state"].shape == (1, 8, H) and set(d) == {"input_ids", "loss_mask", "hidden_state"}


def test_resume_skips_existing_files_even_truncated_ones(server, tmp_path):
    out = tmp_path / "out"
    assert client(server.url, out, 6).returncode == 0
    os.unlink(sample_path(out, 2))
    p4 = sample_path(out, 4)
    p4.write_bytes(p4.read_bytes()[: p4.stat().st_size // 2])  # what a killed writer leaves
    kept = sample_path(out, 0).stat().st_mtime_ns
    r = client(server.url, out, 6, "--resume")
    assert r.returncode == 0, r.stderr
    assert progress_events(r.stderr)[-1].postfix == {"processed": 1, "skipped": 5, "pending_io": 0}
    assert ptfile.check(sample_path(out, 2)) is None
    assert sample_path(out, 0).stat().st_mtime_ns == kept
    # Like SpecForge, existence is all --resume checks: the truncated file stays, and is broken.
    assert "not a complete zip archive" in ptfile.check(p4)
    r = client(server.url, out, 6, "--resume", "--verify-existing")
    assert r.returncode == 0 and "redoing" in r.stderr
    assert progress_events(r.stderr)[-1].postfix["processed"] == 1
    assert ptfile.check(p4) is None


def test_batch_concurrency_and_atomic_give_the_same_files(server, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert client(server.url, a, 5).returncode == 0
    r = client(server.url, b, 5, "--batch", "2", "--concurrency", "2", "--atomic", "--io-workers", "2")
    assert r.returncode == 0, r.stderr
    assert files(b) == files(a)
    assert not [p for p in b.rglob("*") if ".tmp-" in p.name]
    for i in range(5):
        da, db = ptfile.load(sample_path(a, i)), ptfile.load(sample_path(b, i))
        assert da["hidden_state"].storage == db["hidden_state"].storage


def test_crash_fault_exits_nonzero_then_resume_completes(server, tmp_path):
    out = tmp_path / "out"
    r = client(server.url, out, 5, "--fault", "crash", "--fault-at", "2")
    assert r.returncode != 0
    assert "RuntimeError: injected fault: crash at sample 2" in r.stderr
    assert files(out) == ["rows_0-2000/data_0.ckpt", "rows_0-2000/data_1.ckpt"]
    r = client(server.url, out, 5, "--fault", "crash", "--fault-at", "2", "--resume")  # fires once
    assert r.returncode == 0, r.stderr
    assert progress_events(r.stderr)[-1].postfix == {"processed": 3, "skipped": 2, "pending_io": 0}


def test_hang_fault_deadlocks_the_main_thread(server, tmp_path):
    out, log = tmp_path / "out", tmp_path / "client.log"
    argv = [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server", server.url, "--out",
            str(out), "--num-samples", "5", "--seq-len", "8", "--fault", "hang", "--fault-at", "2",
            "--log", str(log)]
    with spawned(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        def at_two():
            ev = progress_events(log.read_text()) if log.exists() else []
            return ev and ev[-1].done == 2
        wait_until(at_two, 20, "progress 2/5")
        wait_until(lambda: len(files(out)) == 2 and task_state(proc.pid) == "S", 10,
                   "the two files written and the main thread asleep")
        assert proc.poll() is None and progress_events(log.read_text())[-1].done == 2


def test_hang_mid_write_leaves_a_truncated_file_at_its_final_path(server, tmp_path):
    """SpecForge's hazard, on demand: the writer stops half-way through a file, alive."""
    from stallwatch.actions.filecheck import validate_file

    out, log = tmp_path / "out", tmp_path / "client.log"
    argv = [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server", server.url, "--out",
            str(out), "--num-samples", "8", "--seq-len", "8", "--fault", "hang_mid_write",
            "--fault-at", "3", "--log", str(log)]
    torn = out / "rows_0-2000" / "data_3.ckpt"
    with spawned(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        wait_until(lambda: torn.exists() and torn.stat().st_size > 0
                   and any(t.name.startswith("data_3") for t in torn.parent.iterdir()), 20,
                   "the torn file")
        wait_until(lambda: task_state(proc.pid) == "S", 10, "the client asleep")
        assert proc.poll() is None
    assert not validate_file(torn).ok
    assert all(validate_file(out / "rows_0-2000" / f"data_{i}.ckpt").ok for i in range(3))
    r = client(server.url, out, 8, "--fault", "hang_mid_write", "--fault-at", "3", "--resume",
               "--verify-existing")  # fires once; the torn file is redone
    assert r.returncode == 0, r.stderr
    assert validate_file(torn).ok


def test_server_hang_makes_the_client_time_out(tmp_path):
    with launch_server([*SERVER_FLAGS, "--fault", "hang", "--fault-after-requests", "2"]) as s:
        out = tmp_path / "out"
        r = client(s.url, out, 5, "--timeout-s", "1.5")
        assert r.returncode == 1
        assert "did not answer within 1.5 s" in r.stderr
        assert files(out) == ["rows_0-2000/data_0.ckpt", "rows_0-2000/data_1.ckpt"]


def test_io_fault_writes_that_sample_elsewhere(server, tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = client(server.url, out, 3, "--fault", "io", "--fault-at", "1", "--io-path", str(elsewhere))
    assert r.returncode == 0, r.stderr
    assert files(out) == ["rows_0-2000/data_0.ckpt", "rows_0-2000/data_2.ckpt"]
    assert ptfile.check(elsewhere / "data_1.ckpt") is None


@pytest.mark.root
@pytest.mark.slow
def test_io_fault_on_a_frozen_fs_blocks_the_writer_in_d(server, tmp_path, root):
    out, log = tmp_path / "out", tmp_path / "client.log"
    with frozen_ext4() as (mnt, _dev):
        argv = [sys.executable, "-m", "stallwatch.sglang.extract_client", "--server", server.url,
                "--out", str(out), "--num-samples", "20", "--seq-len", "8", "--fault", "io",
                "--fault-at", "1", "--io-path", str(mnt), "--log", str(log)]
        with spawned(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
            def writer_in_d():
                return any(task_state(proc.pid, t) == "D" for t in thread_ids(proc.pid))
            wait_until(writer_in_d, 20, "a writer thread in D")
            # generation goes on until --max-pending-io (4) writes are queued, then waits
            wait_until(lambda: (ev := progress_events(log.read_text())) and ev[-1].postfix["pending_io"] == 4,
                       20, "pending_io to reach 4")
            assert proc.poll() is None and progress_events(log.read_text())[-1].done < 20


# ---------------------------------------------------------------------------------- ptfile


def test_ptfile_round_trip_without_torch(tmp_path):
    T = ptfile.Tensor
    obj = {"i64": T.from_list([[1, -2], [3, 2**40]], "int64"), "f32": T.from_list([1.5, -0.25], "float32"),
           "bf16": T.from_list([[1.0, 1.00390625, -2.5e-3]], "bfloat16"), "i32": T.from_list([7], "int32"),
           "f16": T.from_list([0.5, 65504.0], "float16"), "b": T.from_list([True, False], "bool"),
           "u8": T.from_list([0, 255], "uint8"), "empty": T.from_list([], "float32"),
           "n": 3, "big": 2**70, "x": -1.5, "s": "é", "l": [1, None, True, (2, 3)],
           "d": {"k": [T.from_list([1], "int8")]}}
    path = tmp_path / "x.ckpt"
    ptfile.save(obj, path, use_torch=False)
    back = ptfile.load(path)
    assert back["i64"].tolist() == [[1, -2], [3, 2**40]] and back["i64"].shape == (2, 2)
    assert back["f32"].tolist() == [1.5, -0.25]
    assert back["bf16"].tolist()[0][:2] == [1.0, 1.0]  # 1 + 2^-8 rounds to even in bfloat16
    assert abs(back["bf16"].tolist()[0][2] + 2.5e-3) < 2e-5
    assert back["f16"].tolist() == [0.5, 65504.0] and back["b"].tolist() == [True, False]
    assert back["u8"].tolist() == [0, 255] and back["empty"].shape == (0,)
    assert {k: back[k] for k in ("n", "big", "x", "s", "l")} == {"n": 3, "big": 2**70, "x": -1.5, "s": "é",
                                                                "l": [1, None, True, (2, 3)]}
    assert back["d"]["k"][0].tolist() == [1]
    with zipfile.ZipFile(path) as zf:  # torch's layout, every record 64-byte aligned
        names = zf.namelist()
        assert names[0] == "archive/data.pkl" and "archive/version" in names and "archive/byteorder" in names
        raw = path.read_bytes()
        for info in zf.infolist():
            start = info.header_offset + 30 + len(info.filename) + int.from_bytes(raw[info.header_offset + 28:
                                                                                    info.header_offset + 30], "little")
            assert start % 64 == 0, info.filename


def test_ptfile_check_names_what_is_wrong(tmp_path):
    good = tmp_path / "good.ckpt"
    ptfile.save({"h": ptfile.Tensor.from_list([[1.0] * 64] * 4, "float32")}, good, use_torch=False)
    raw = good.read_bytes()
    (tmp_path / "trunc.ckpt").write_bytes(raw[: len(raw) - 30])
    assert "not a complete zip archive" in ptfile.check(tmp_path / "trunc.ckpt")
    i = raw.index(b"\x00\x00\x80\x3f")  # inside the float data: the CRC no longer matches
    (tmp_path / "crc.ckpt").write_bytes(raw[:i] + b"\x01" + raw[i + 1:])
    assert "CRC mismatch" in ptfile.check(tmp_path / "crc.ckpt")
    (tmp_path / "text.ckpt").write_text("hello")
    assert ptfile.check(tmp_path / "text.ckpt") is not None
    evil = tmp_path / "evil.ckpt"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR.")
        zf.writestr("archive/version", b"3\n")
    assert "not allowed" in ptfile.check(evil)
    with pytest.raises(ptfile.PtFileError):
        ptfile.load(evil)


def test_ptfile_atomic_save_replaces_whole_and_cleans_up(tmp_path):
    path = tmp_path / "a.ckpt"
    ptfile.save({"v": 1}, path, atomic=True, use_torch=False)
    ptfile.save({"v": 2}, path, atomic=True, use_torch=False)
    assert ptfile.load(path) == {"v": 2}
    with pytest.raises(TypeError):
        ptfile.save({"v": object()}, path, atomic=True, use_torch=False)
    assert ptfile.load(path) == {"v": 2} and [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]


@pytest.mark.skipif(not has("torch"), reason="needs torch (cross-check with torch.save/torch.load)")
def test_ptfile_and_torch_read_each_other(tmp_path):
    import torch

    T = ptfile.Tensor
    vals = [float(v) for v in torch.randn(257, generator=torch.Generator().manual_seed(1)).tolist()]
    ours = tmp_path / "ours.ckpt"
    ptfile.save({"bf": T.from_list(vals, "bfloat16"), "ids": T.from_list([1, 2, 3], "int64"), "k": "v"},
                ours, use_torch=False)
    d = torch.load(ours, weights_only=True)
    assert torch.equal(d["bf"], torch.tensor(vals, dtype=torch.bfloat16))  # same rounding as torch
    assert d["ids"].tolist() == [1, 2, 3] and d["k"] == "v"
    assert torch.load(ours, weights_only=True, mmap=True)["ids"].tolist() == [1, 2, 3]
    theirs = tmp_path / "theirs.pt"
    x = torch.randn(3, 5).to(torch.bfloat16)
    torch.save({"x": x, "view": x[:, 1:3], "h": torch.ones(2, dtype=torch.half)}, theirs)
    back = ptfile.load(theirs)
    assert back["x"].tolist() == x.float().tolist() and back["view"].tolist() == x[:, 1:3].float().tolist()
    assert back["h"].tolist() == [1.0, 1.0] and ptfile.check(theirs) is None


# ---------------------------------------------------------------------------- progress bar


def test_hand_bar_is_tqdm_format_and_parses(tmp_path):
    import io

    buf = io.StringIO()
    bar = HandBar(10, "Generating Hidden States", buf, mininterval=0.0)
    for i in range(10):
        bar.update(1)
        bar.set_postfix({"processed": i + 1, "skipped": 0, "pending_io": 1})
    bar.close()
    events = progress_events(buf.getvalue())
    assert events[-1].done == 10 and events[-1].total == 10 and events[-1].rate_per_s is not None
    assert buf.getvalue().endswith("\n")


@pytest.mark.skipif(not has("tqdm"), reason="needs tqdm to compare against")
@pytest.mark.parametrize("n,total,elapsed,rate,postfix", [
    (0, 37312, 0.0, None, ""),
    (4, 10, 1.2, 3.2, "processed=4, skipped=0, pending_io=1"),
    (18380, 37312, 17890.0, 1.03, "processed=18380, skipped=5, pending_io=0"),
    (3, 7, 5.0, 0.4, "x=1"),
    (7, 7, 3725.0, 2.0, ""),
])
def test_hand_format_matches_tqdm(n, total, elapsed, rate, postfix):
    from tqdm import tqdm

    want = tqdm.format_meter(n, total, elapsed, prefix="Generating Hidden States", rate=rate,
                             postfix=postfix or None)
    assert format_meter(n, total, elapsed, rate, "Generating Hidden States", postfix) == want
