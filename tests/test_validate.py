"""validate_file on archives made the way torch.save makes them (and by torch itself, when it
is installed), and validate_outputs on an output tree like SpecForge's, with the quarantine on
the same filesystem and on another one.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest

from stallwatch.actions.filecheck import LEGACY_MAGIC, validate_file
from stallwatch.actions.quarantine import quarantine_file
from stallwatch.actions.validate import validate_outputs
from stallwatch.clock import FakeClock

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _u(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def torch_like_pickle(storages: dict[str, tuple[str, int]]) -> bytes:
    """data.pkl opcode for opcode as torch.save writes it (protocol 2): a dict of
    _rebuild_tensor_v2(persistent ('storage', torch.<Type>Storage, key, 'cpu', numel), ...),
    with torch's own global names, made without torch."""
    out = [b"\x80\x02", b"}", b"("]
    for key, (tname, numel) in storages.items():
        out += [_u(f"t{key}"), b"ctorch._utils\n_rebuild_tensor_v2\n", b"(",
                b"(", _u("storage"), f"ctorch\n{tname}\n".encode(), _u(key), _u("cpu"),
                _int(numel), b"t", b"Q",
                _int(0), _int(numel), b"\x85", _int(1), b"\x85", b"\x89",
                b"ccollections\nOrderedDict\n", b")", b"R", b"t", b"R"]
    out += [b"u", b"."]
    return b"".join(out)


ELEM = {"FloatStorage": 4, "LongStorage": 8, "BFloat16Storage": 2}


def write_torch_zip(path: Path, storages: dict[str, tuple[str, int]] | None = None) -> bytes:
    """A zip laid out like torch.save's: stored members under <stem>/, data.pkl first."""
    storages = storages or {"0": ("FloatStorage", 1024), "1": ("LongStorage", 64)}
    stem = path.stem
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{stem}/data.pkl", torch_like_pickle(storages))
        zf.writestr(f"{stem}/byteorder", "little")
        for key, (tname, numel) in storages.items():
            zf.writestr(f"{stem}/data/{key}", os.urandom(numel * ELEM[tname]))
        zf.writestr(f"{stem}/version", "3\n")
    return path.read_bytes()


# ------------------------------------------------------------------------------ one file


def test_valid_zip(tmp_path):
    p = tmp_path / "data_0.ckpt"
    write_torch_zip(p)
    ok, reason = validate_file(p, use_torch=False)
    assert ok, reason
    assert "whole" in reason


def test_truncated_zip_cut_in_half(tmp_path):
    p = tmp_path / "data_0.ckpt"
    data = write_torch_zip(p)
    p.write_bytes(data[: len(data) // 2])
    ok, reason = validate_file(p, use_torch=False)
    assert not ok and "not whole" in reason


@pytest.mark.parametrize("cut", [1, 22, 100])
def test_zip_missing_its_last_bytes(tmp_path, cut):
    p = tmp_path / "data_0.pt"
    data = write_torch_zip(p)
    p.write_bytes(data[:-cut])
    assert not validate_file(p, use_torch=False).ok


def test_zero_length(tmp_path):
    p = tmp_path / "data_0.pt"
    p.touch()
    ok, reason = validate_file(p)
    assert not ok and "empty" in reason


def test_garbage(tmp_path):
    p = tmp_path / "data_0.pt"
    p.write_bytes(os.urandom(4096))
    ok, reason = validate_file(p, use_torch=False)
    assert not ok, reason


def test_missing_and_not_regular(tmp_path):
    assert validate_file(tmp_path / "nope.pt") == (False, "missing")
    assert not validate_file(tmp_path).ok


def test_crc_mismatch_with_whole_directory(tmp_path):
    p = tmp_path / "data_0.ckpt"
    data = bytearray(write_torch_zip(p))
    info = zipfile.ZipFile(p).getinfo("data_0/data/0")
    h = info.header_offset
    name_len, extra_len = struct.unpack("<HH", data[h + 26:h + 30])
    data[h + 30 + name_len + extra_len + 100] ^= 0xFF  # inside the member's data
    p.write_bytes(data)
    ok, reason = validate_file(p, use_torch=False)
    assert not ok and "CRC" in reason
    # Over the CRC limit only the structure is checked: whole, with a note.
    ok, reason = validate_file(p, use_torch=False, crc_max_bytes=10)
    assert ok and "CRC not checked" in reason


def test_storage_size_mismatch(tmp_path):
    """data.pkl says 1024 floats, the member holds fewer bytes: caught without torch."""
    p = tmp_path / "data_0.pt"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("data_0/data.pkl", torch_like_pickle({"0": ("FloatStorage", 1024)}))
        zf.writestr("data_0/data/0", b"\0" * 1000)
    ok, reason = validate_file(p, use_torch=False)
    assert not ok and "needs 4096" in reason


def test_zip_without_data_pkl_is_not_a_torch_file(tmp_path):
    p = tmp_path / "x.pt"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("hello.txt", "hi")
    ok, reason = validate_file(p, use_torch=False)
    assert not ok and "data.pkl" in reason


def test_pickle_is_never_executed(tmp_path):
    """A data.pkl that would run a function if loaded is only parsed."""
    p = tmp_path / "evil.pt"
    marker = tmp_path / "ran"
    evil = pickle.dumps(_Touch(str(marker)), protocol=2)
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("evil/data.pkl", evil)
    ok, _ = validate_file(p, use_torch=False)
    assert ok and not marker.exists()


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def legacy_bytes(storages: dict[str, tuple[str, int]]) -> bytes:
    """torch.save(..., _use_new_zipfile_serialization=False): five pickles, then the storages."""
    buf = io.BytesIO()
    for obj in (LEGACY_MAGIC, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(obj, buf, protocol=2)
    buf.write(torch_like_pickle(storages))
    pickle.dump(sorted(storages), buf, protocol=2)
    for key in sorted(storages):
        tname, numel = storages[key]
        buf.write(struct.pack("<q", numel) + b"\1" * (numel * ELEM[tname]))
    return buf.getvalue()


def test_legacy_torch_pickle(tmp_path):
    p = tmp_path / "old.pt"
    data = legacy_bytes({"0": ("FloatStorage", 16), "1": ("LongStorage", 4)})
    p.write_bytes(data)
    ok, reason = validate_file(p, use_torch=False)
    assert ok and "legacy" in reason, reason
    for cut in (len(data) - 1, len(data) // 2, 10):
        p.write_bytes(data[:cut])
        assert not validate_file(p, use_torch=False).ok, cut
    p.write_bytes(pickle.dumps({"a": 1}))  # a pickle, but not torch's
    ok, reason = validate_file(p, use_torch=False)
    assert not ok and "magic" in reason


def test_safetensors(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "I64", "shape": [1], "data_offsets": [24, 32]},
              "__metadata__": {"format": "pt"}}
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + os.urandom(32)
    p = tmp_path / "model.safetensors"
    p.write_bytes(data)
    assert validate_file(p).ok
    p.write_bytes(data[:-1])
    ok, reason = validate_file(p)
    assert not ok and "need 32" in reason
    p.write_bytes(data[:20])
    assert not validate_file(p).ok


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install torch==2.13.0 "
                                          "in a separate venv to run this)")
def test_real_torch_files(tmp_path):
    import torch

    d = {"input_ids": torch.arange(100), "hidden_state": torch.randn(16, 32),
         "loss_mask": torch.ones(100, dtype=torch.bool)}
    new, old = tmp_path / "new.ckpt", tmp_path / "old.pt"
    torch.save(d, new)
    torch.save(d, old, _use_new_zipfile_serialization=False)
    for p in (new, old):
        ok, reason = validate_file(p)
        assert ok and "torch.load ok" in reason, reason
        assert validate_file(p, use_torch=False).ok
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
        assert not validate_file(p).ok
        p.write_bytes(data[:-1])
        assert not validate_file(p).ok


# ------------------------------------------------------------------------------ the tree


def build_outputs(root: Path, old_mtime: float, new_mtime: float) -> dict[str, Path]:
    """rows_0-2000/ with one good, one truncated and one empty file (recent), rows_2000-4000/
    with an old truncated file, and a non-matching notes file."""
    files = {
        "good": root / "rows_0-2000" / "data_0.ckpt",
        "cut": root / "rows_0-2000" / "data_1.ckpt",
        "empty": root / "rows_0-2000" / "data_2.ckpt",
        "old_cut": root / "rows_2000-4000" / "data_0.ckpt",
        "notes": root / "rows_0-2000" / "notes.txt",
    }
    for f in files.values():
        f.parent.mkdir(parents=True, exist_ok=True)
    write_torch_zip(files["good"])
    data = write_torch_zip(files["cut"])
    files["cut"].write_bytes(data[: len(data) // 2])
    files["empty"].touch()
    files["old_cut"].write_bytes(data[:100])
    files["notes"].write_text("")
    for name, f in files.items():
        t = old_mtime if name == "old_cut" else new_mtime
        os.utime(f, (t, t))
    return files


def test_quarantine_keeps_relative_paths_and_filters_by_since(tmp_path):
    out, q = tmp_path / "out", tmp_path / "quarantine"
    files = build_outputs(out, old_mtime=1_000_000.0, new_mtime=2_000_000.0)
    cut_bytes = files["cut"].read_bytes()
    rep = validate_outputs(out, 1_500_000.0, q, clock=FakeClock(), use_torch=False)
    assert rep.checked == 3 and rep.valid == 1 and rep.safe_to_resume, rep
    assert rep.scanned == 5
    moved = {Path(src).relative_to(out): Path(dst).relative_to(q) for src, dst, _ in
             rep.quarantined}
    assert moved == {Path("rows_0-2000/data_1.ckpt"): Path("rows_0-2000/data_1.ckpt"),
                     Path("rows_0-2000/data_2.ckpt"): Path("rows_0-2000/data_2.ckpt")}
    assert not files["cut"].exists() and not files["empty"].exists()
    assert (q / "rows_0-2000" / "data_1.ckpt").read_bytes() == cut_bytes  # moved, intact
    assert files["good"].exists() and files["old_cut"].exists()  # too old: not looked at
    reasons = {Path(src).name: r for src, _, r in rep.quarantined}
    assert "empty" in reasons["data_2.ckpt"] and "not whole" in reasons["data_1.ckpt"]
    manifest = [json.loads(line) for line in (q / "MANIFEST.jsonl").read_text().splitlines()]
    assert {m["dst"] for m in manifest} == {dst for _, dst, _ in rep.quarantined}

    # since_wall=None: everything, including the old broken file.
    rep = validate_outputs(out, None, q, use_torch=False)
    assert [Path(s).relative_to(out) for s, _, _ in rep.quarantined] == [
        Path("rows_2000-4000/data_0.ckpt")]


def test_quarantine_never_overwrites(tmp_path):
    out, q = tmp_path / "out", tmp_path / "out" / ".quarantine"  # inside the tree: not walked
    (out / "rows_0").mkdir(parents=True)
    bad = out / "rows_0" / "data_7.pt"
    contents = []
    for n in range(3):  # the same file fails in three incidents
        bad.write_bytes(b"garbage %d" % n)
        contents.append(bad.read_bytes())
        rep = validate_outputs(out, None, q, use_torch=False)
        assert len(rep.quarantined) == 1 and rep.checked == 1, rep
    names = sorted(p.name for p in (q / "rows_0").iterdir())
    assert names == ["data_7.pt", "data_7.pt.1", "data_7.pt.2"]
    assert [(q / "rows_0" / n).read_bytes() for n in names] == contents


def test_quarantine_file_across_filesystems(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temp dir")
    src = tmp_path / "rows" / "data_1.pt"
    src.parent.mkdir()
    src.write_bytes(os.urandom(300_000))
    data = src.read_bytes()
    qdir = Path(os.path.realpath(shm)) / f"stallwatch-test-{os.getpid()}-{tmp_path.name}"
    try:
        (qdir / "rows").mkdir(parents=True)
        (qdir / "rows" / "data_1.pt").write_bytes(b"taken")
        dst = quarantine_file(src, qdir / "rows" / "data_1.pt")
        assert dst.name == "data_1.pt.1" and dst.read_bytes() == data and not src.exists()
        assert (qdir / "rows" / "data_1.pt").read_bytes() == b"taken"
    finally:
        for p in sorted(qdir.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        qdir.rmdir()


def test_open_files_dry_run_candidates_and_limits(tmp_path):
    out, q = tmp_path / "out", tmp_path / "q"
    files = build_outputs(out, old_mtime=1_000_000.0, new_mtime=2_000_000.0)
    # A file open for writing by a live process is not touched, and blocks the resume.
    rep = validate_outputs(out, 1_500_000.0, q, open_paths={str(files["cut"])}, use_torch=False)
    assert [s.path for s in rep.skipped] == [str(files["cut"])]
    assert files["cut"].exists() and not rep.safe_to_resume
    assert "live process" in rep.skipped[0].reason

    # A dry run says what it would move and moves nothing.
    files = build_outputs(tmp_path / "out2", 1_000_000.0, 2_000_000.0)
    rep = validate_outputs(tmp_path / "out2", 1_500_000.0, tmp_path / "q2", dry_run=True,
                           use_torch=False)
    assert len(rep.quarantined) == 2 and files["cut"].exists() and files["empty"].exists()
    assert not (tmp_path / "q2").exists() and not rep.safe_to_resume

    # An old file named as a candidate (the job had it open when killed) is checked anyway.
    rep = validate_outputs(tmp_path / "out2", 1_500_000.0, tmp_path / "q2", dry_run=True,
                           candidates=[files["old_cut"], tmp_path / "elsewhere.pt"],
                           use_torch=False)
    assert str(files["old_cut"]) in {s for s, _, _ in rep.quarantined}
    assert [s.reason for s in rep.skipped] == ["outside the outputs directory: not touched"]

    # max_files: newest first, the rest reported as skipped.
    now = 3_000_000.0
    os.utime(files["good"], (now, now))
    rep = validate_outputs(tmp_path / "out2", 1_500_000.0, tmp_path / "q2", max_files=1,
                           dry_run=True, use_torch=False)
    assert rep.checked == 1 and rep.valid == 1 and len(rep.skipped) == 2
    assert all("max_files" in s.reason for s in rep.skipped)
    # ... but a candidate before them, whatever its age: it is the likeliest broken one
    rep = validate_outputs(tmp_path / "out2", 1_500_000.0, tmp_path / "q2", max_files=1,
                           candidates=[files["old_cut"]], dry_run=True, use_torch=False)
    assert rep.checked == 1 and [s for s, _, _ in rep.quarantined] == [str(files["old_cut"])]


def test_missing_outputs_dir_is_nothing_to_check(tmp_path):
    rep = validate_outputs(tmp_path / "never-made", None, tmp_path / "q")
    assert rep.safe_to_resume and rep.checked == 0 and "does not exist" in rep.notes[0]


def _deep_tree(top: Path, depth: int) -> None:
    """`depth` nested directories, made relative to fds (the full path may pass PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    with open(os.open("deep.pt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
        f.write(b"broken")
    os.close(fd)


def _remove_deep(top: Path) -> None:
    """Remove a chain made by _deep_tree (and its quarantine copy) without recursion: pytest's
    own clean-up of its temp dirs is recursive and would fail on it, for every later session."""
    if not top.exists():
        return
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    while True:
        try:
            fds.append(os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        except FileNotFoundError:
            break
    for i in range(len(fds) - 1, 0, -1):
        for name in os.listdir(fds[i]):
            os.unlink(name, dir_fd=fds[i])
        os.close(fds[i])
        os.rmdir("d", dir_fd=fds[i - 1])
    os.close(fds[0])


def test_a_1500_deep_tree_is_walked_iteratively_and_cut_at_max_depth(tmp_path):
    """security.md #12: the walk was recursive (os.walk): 25 s of CPU, then RecursionError."""
    out, q = tmp_path / "out", tmp_path / "q"
    out.mkdir()
    try:
        _deep_checks(out, q)
    finally:
        _remove_deep(out)
        _remove_deep(q)


def _deep_checks(out: Path, q: Path) -> None:
    (out / "top.pt").write_bytes(b"broken")
    _deep_tree(out, 1500)
    rep = validate_outputs(out, None, q, use_torch=False, max_depth=64)
    assert [Path(s).name for s, _, _ in rep.quarantined] == ["top.pt"]
    deep, = rep.skipped
    assert "max_depth=64" in deep.reason and deep.path.count("/d") == 65  # 64 walked
    assert rep.duration_s < 10 and not rep.errors
    # with the bound above the tree's depth, the walk reaches its bottom, iteratively
    rep = validate_outputs(out, None, q, use_torch=False, max_depth=2000)
    assert [Path(s).name for s, _, _ in rep.quarantined] == ["deep.pt"] and not rep.skipped


def test_a_file_swapped_for_a_symlink_or_device_is_never_moved(tmp_path):
    """security.md #4, without the race: what the walk did not see as a regular file is never
    opened, copied or moved, and a name that changed since the walk is left alone."""
    out, q = tmp_path / "out", tmp_path / "q"
    (out / "sub").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret.pt").write_bytes(b"not the job's")
    os.symlink(victim, out / "sub" / "link")
    os.symlink("/dev/zero", out / "zero.pt")
    os.symlink(victim / "secret.pt", out / "secret.pt")
    rep = validate_outputs(out, None, q, use_torch=False,
                           candidates=[out / "sub" / "link" / "secret.pt", out / "zero.pt"])
    assert rep.quarantined == () and rep.checked == 0, rep
    assert (victim / "secret.pt").read_bytes() == b"not the job's"
    # a validation reason never quotes the file's bytes (nor a member's name)
    (out / "evil.pt").write_bytes(b"PWNED-BYTES")  # pickle: "invalid load key, 'P'."
    rep = validate_outputs(out, None, q, use_torch=False)
    (_, _, reason), = rep.quarantined
    assert "'P'" not in reason and reason.endswith("UnpicklingError"), reason


def test_validation_leaves_no_descriptor_open(tmp_path):
    out, q = tmp_path / "out", tmp_path / "q"
    files = build_outputs(out, old_mtime=1_000_000.0, new_mtime=2_000_000.0)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        validate_outputs(out, None, q, use_torch=False, dry_run=True)
    validate_outputs(out, None, q, use_torch=False)
    assert not files["cut"].exists()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.root
def test_a_full_quarantine_renames_the_broken_file_aside_in_place(tmp_path):
    """The quarantine lives in the state directory: when that filesystem is full, the broken
    file is renamed aside in its own folder (a name no output pattern matches), so the resume
    rewrites it and no validation takes it for an output; nothing is lost, nothing given up."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts a 64 KiB tmpfs as the quarantine's filesystem)")
    from faultrigs import fill_up, small_tmpfs

    with small_tmpfs(tmp_path / "small", "64k") as small:
        q = small / "quarantine"
        q.mkdir()
        fill_up(small / "fill")
        out = tmp_path / "out"
        files = build_outputs(out, old_mtime=1_000_000.0, new_mtime=2_000_000.0)
        cut_bytes = files["cut"].read_bytes()
        rep = validate_outputs(out, 1_500_000.0, q, clock=FakeClock(), use_torch=False)
        assert rep.safe_to_resume and not rep.errors, rep
        aside = files["cut"].with_name("data_1.ckpt.stallwatch-broken")
        assert not files["cut"].exists() and aside.read_bytes() == cut_bytes
        # The empty file still fits (an inode, no data): it goes to the quarantine as usual.
        where = {Path(src).name: (Path(dst), why) for src, dst, why in rep.quarantined}
        assert where["data_1.ckpt"][0] == aside and "renamed aside in place" in where["data_1.ckpt"][1]
        assert where["data_2.ckpt"][0] == q / "rows_0-2000" / "data_2.ckpt"
        # a second validation does not take the renamed files for outputs
        again = validate_outputs(out, None, q, use_torch=False)
        assert {Path(s).name for s, _, _ in again.quarantined} == {"data_0.ckpt"}  # old_cut
