"""Zero-config discovery: `stallwatch diagnose --json` with no arguments finds the pipeline.

The pair runs under unrelated names and paths: the protocol server as `inference_backend.py`
started through a symlinked interpreter called `engine` (so nothing on its command line says
sglang or stallwatch: only its children's titles, `sglang::scheduler` and `sglang::detokenizer`,
give it away), the extraction client as `prep_data.py`, its stderr into a file in a folder with
a space in its name, writing its outputs below `weird dir/hs`. Discovery must find the client's
pid, its log, its outputs and the server URL, and diagnose must judge it: healthy while it
works; then `hang` once the client deadlocked (its own fault hook) and its log has been silent
for 30 s, or `server_hang` once the scheduler was SIGSTOPped that long.

Each scenario runs in a driver process, in a PID namespace of its own when `unshare` allows it
(root), so other pipelines on the same host (other tests, other users) cannot be discovered
instead; without one it runs on the host as is. The scenarios take ~60 s each, mostly waiting
for the stall to age, so the module fixture starts the selected ones together.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

DRIVER = r'''
import json, os, signal, subprocess, sys, time, urllib.request
from pathlib import Path

scenario, work = sys.argv[1], Path(sys.argv[2])
STUCK_S = 30.0  # the log silent this long before the stalled diagnosis (threshold 20 s + 2 s)
out = {"scenario": scenario, "events": []}
procs = []

def note(what):
    out["events"].append(f"{time.monotonic() - T0:6.1f}s {what}")

def wait_for(probe, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        v = probe()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)

def progress(log):
    try:
        text = log.read_bytes()[-4000:].decode("utf-8", "replace")
    except OSError:
        return 0
    import re
    found = re.findall(r"(\d+)/(\d+) \[", text)
    return int(found[-1][0]) if found else 0

def diagnose():
    r = subprocess.run([sys.executable, "-m", "stallwatch", "diagnose", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=str(work))
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {"unparsed": r.stdout[-2000:]}
    return {"rc": r.returncode, "doc": doc, "stderr": r.stderr[-6000:]}

T0 = time.monotonic()
try:
    (work / "srv").mkdir()
    (work / "weird dir").mkdir()
    engine = work / "engine"
    os.symlink(os.path.realpath(sys.executable), engine)
    (work / "srv" / "inference_backend.py").write_text(
        "import sys\nfrom stallwatch.sglang.protocol_server import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n")
    (work / "prep_data.py").write_text(
        "import sys\nfrom stallwatch.sglang.extract_client import main\n"
        "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    port_file = work / "port"
    srv_out = open(work / "srv" / "backend.console", "wb")
    server = subprocess.Popen([str(engine), "inference_backend.py", "--port", "0", "--port-file",
                               str(port_file), "--device", "python", "--hidden-size", "32",
                               "--num-layers", "2", "--enable-metrics",
                               "--enable-return-hidden-states", "--forward-delay-s", "0.3"],
                              cwd=str(work / "srv"), stdout=srv_out, stderr=srv_out,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    procs.append(server)
    port = int(wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 60,
                        "the server's port"))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _ready(url), 60, "the server to be ready")
    note(f"server pid {server.pid} on {url}")
    log = work / "weird dir" / "prep console.txt"
    outputs = work / "weird dir" / "hs"
    argv = [str(engine), "prep_data.py", "--server", url, "--out", str(outputs),
            "--num-samples", "400", "--seq-len", "16", "--resume"]
    if scenario == "hang":
        argv += ["--fault", "hang", "--fault-at", "60"]
    with open(log, "ab") as err:
        client = subprocess.Popen(argv, cwd=str(work), stdout=subprocess.DEVNULL, stderr=err,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    procs.append(client)
    sched = wait_for(lambda: [int(p) for p in os.listdir("/proc") if p.isdigit()
                              and _ppid(int(p)) == server.pid
                              and _cmd(int(p)).startswith("sglang::scheduler")], 30,
                     "the scheduler")[0]
    out.update(server=server.pid, scheduler=sched, client=client.pid, url=url, log=str(log),
               outputs=str(outputs))
    wait_for(lambda: progress(log) >= 8, 60, "8 samples of progress")
    note(f"client pid {client.pid} at {progress(log)}")
    out["healthy"] = diagnose()
    note(f"healthy diagnosis done at {progress(log)}")
    if scenario == "server_hang":
        os.kill(sched, signal.SIGSTOP)
        note(f"SIGSTOP scheduler {sched}")
    wait_for(lambda: time.time() - log.stat().st_mtime >= STUCK_S, STUCK_S + 90,
             f"the log to be silent for {STUCK_S:g} s")
    note(f"log silent {time.time() - log.stat().st_mtime:.1f} s at {progress(log)}")
    out["stalled"] = diagnose()
    note("stalled diagnosis done")
except BaseException as e:
    import traceback
    out["error"] = traceback.format_exc()
finally:
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(10)
        except Exception:
            pass
    print(json.dumps(out))
'''

DRIVER_HELPERS = r'''
def _ready(url):
    import urllib.request
    try:
        return urllib.request.urlopen(url + "/ready", timeout=2).status == 200
    except Exception:
        return False

def _ppid(pid):
    try:
        s = open(f"/proc/{pid}/stat").read()
        return int(s[s.rfind(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1

def _cmd(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
'''


def _env() -> dict[str, str]:
    # The symlinked interpreter is outside the venv: it finds stallwatch and its dependencies
    # through PYTHONPATH only.
    paths = [str(REPO), *site.getsitepackages()]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _isolation() -> list[str]:
    """`unshare --pid --fork --mount-proc` when it works here: a /proc with only our processes."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["unshare", "--pid", "--fork", "--mount-proc"] if r.returncode == 0 else []


class Scenario:
    def __init__(self, name: str, prefix: list[str]) -> None:
        self.name = name
        self.work = Path(tempfile.mkdtemp(prefix=f"sw-discover-{name}-"))
        script = self.work / "driver.py"
        script.write_text(DRIVER_HELPERS + DRIVER)
        self.proc = subprocess.Popen([*prefix, sys.executable, str(script), name, str(self.work)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=_env(), cwd=str(self.work))
        self.result: dict | None = None

    def wait(self) -> dict:
        if self.result is None:
            try:
                out, err = self.proc.communicate(timeout=280)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
            try:
                self.result = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                self.result = {"error": f"driver said: {out[-2000:]}\n{err[-4000:]}"}
            self.result["driver_stderr"] = err[-4000:]
        return self.result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


@pytest.fixture(scope="module")
def scenarios(request):
    wanted = [item.function.scenario for item in request.session.items
              if item.module is request.module and hasattr(item.function, "scenario")]
    prefix = _isolation()
    running = {name: Scenario(name, prefix) for name in dict.fromkeys(wanted)}
    yield running, prefix
    for s in running.values():
        s.close()


def uses(name: str):
    def deco(fn):
        fn.scenario = name
        return fn
    return deco


def _result(scenarios, name: str) -> dict:
    running, _prefix = scenarios
    r = running[name].wait()
    assert "error" not in r, r["error"]
    return r


def _fmt(d: dict) -> str:
    v = d["doc"].get("verdict", {})
    ev = "\n  ".join(f"{e['signal']}: {e['detail']}" for e in v.get("evidence", []))
    return f"rc {d['rc']}: {v.get('kind')}: {v.get('summary')}\n  {ev}\nstderr:\n{d['stderr']}"


def _assert_found(r: dict, d: dict) -> None:
    """The discovered target is the client, with its log, outputs and the server URL."""
    t = d["doc"]["target"]
    assert t["pids"] == [r["client"]], _fmt(d)
    assert t["log"] == r["log"], _fmt(d)
    assert t["outputs"] == r["outputs"], _fmt(d)
    assert t["server"] == r["url"], _fmt(d)
    assert t["name"] == "prep_data"
    err = d["stderr"]
    assert f"discovered: server: pid {r['server']}" in err, err
    assert "sglang::scheduler" in err and f"port {r['url'].rsplit(':', 1)[1]}" in err, err
    assert f"discovered: client: pid {r['client']}" in err, err
    assert f"discovered: log: {r['log']} (its stderr (fd 2)" in err, err
    assert f"discovered: outputs: {r['outputs']}" in err, err
    assert [p["pid"] for p in d["doc"]["processes"] if p["role"] == "target"] == [r["client"]]


@pytest.mark.slow
@uses("hang")
def test_discovers_renamed_pair_healthy_then_hang(scenarios) -> None:
    r = _result(scenarios, "hang")
    h = r["healthy"]
    _assert_found(r, h)
    assert h["doc"]["verdict"]["kind"] == "healthy" and h["rc"] == 0, _fmt(h)
    assert h["doc"]["server"]["port"] == int(r["url"].rsplit(":", 1)[1])
    s = r["stalled"]
    _assert_found(r, s)
    assert s["doc"]["verdict"]["kind"] == "hang" and s["rc"] == 2, _fmt(s)
    assert s["doc"]["progress"]["last_progress_age_s"] >= 25, _fmt(s)


@pytest.mark.slow
@uses("server_hang")
def test_discovers_renamed_pair_healthy_then_server_hang(scenarios) -> None:
    r = _result(scenarios, "server_hang")
    h = r["healthy"]
    _assert_found(r, h)
    assert h["doc"]["verdict"]["kind"] == "healthy" and h["rc"] == 0, _fmt(h)
    s = r["stalled"]
    _assert_found(r, s)
    assert s["doc"]["verdict"]["kind"] == "server_hang" and s["rc"] == 2, _fmt(s)
    ev = "\n".join(e["detail"] for e in s["doc"]["verdict"]["evidence"])
    assert f"TP0 pid {r['scheduler']}: state T" in ev, _fmt(s)


def test_nothing_to_discover_is_a_usage_error() -> None:
    prefix = _isolation()
    if not prefix:
        pytest.skip("needs a PID namespace of its own (root and unshare): the host may run "
                    "pipelines that discovery would rightly find")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("NVML would report the host's GPU processes")
    r = subprocess.run([*prefix, sys.executable, "-m", "stallwatch", "diagnose", "--json"],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 3, r.stderr
    assert "no target given" in r.stderr and "--pid" in r.stderr


# ------------------------------------------------------------------ the log and outputs, fast


def _wait_file(path: Path, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size > 0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never written")
        time.sleep(0.02)


JOB = """
import os, sys, time
out, marker = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(out, "shard_0"), exist_ok=True)
for i in range(3):
    with open(os.path.join(out, "shard_0", f"x_{i}.pt"), "wb") as f:
        f.write(b"PK")
keep = open(os.path.join(out, "shard_0", "partial.ckpt"), "wb")  # open for writing: a candidate
log = open(sys.argv[3], "a") if len(sys.argv) > 3 else None
print("step 1/10", flush=True)
if log:
    log.write("step 1/10\\n"); log.flush()
open(marker, "w").write("ready")
time.sleep(60)
"""


def _host():
    from stallwatch.probes.discover import _Host
    from stallwatch.kernel.roots import DEFAULT_ROOTS

    return _Host(DEFAULT_ROOTS)


def test_log_through_tee_and_outputs_below_the_named_folder(tmp_path: Path) -> None:
    """stdout into `tee run.log`: the log is the file at the other end of the pipe; the outputs
    are the folder the command line names, not the shard folder the files are in."""
    from stallwatch.probes.discover_files import _find_outputs, find_log as _find_log

    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "my outputs"
    marker = tmp_path / "m"
    p = subprocess.Popen(["sh", "-c", f'"{sys.executable}" "{job}" "$1" "$2" | tee "$3" >/dev/null',
                          "sh", str(out), str(marker), str(tmp_path / "run.log")],
                         start_new_session=True)
    try:
        _wait_file(marker)
        _wait_file(tmp_path / "run.log")
        host = _host()
        pid = next(c for c in host.children.get(p.pid, [])
                   if host.procs[c].cmdline[:2] == (sys.executable, str(job)))
        log, how = _find_log(host, pid)
        assert log == str(tmp_path / "run.log") and "pipe read by pid" in how and "tee" in how
        outputs, how = _find_outputs(host, pid, log)
        assert outputs == str(out), how
        assert "open for writing" in how or "below" in how
    finally:
        os.killpg(p.pid, 9)
        p.wait()


def test_log_opened_for_append(tmp_path: Path) -> None:
    from stallwatch.probes.discover_files import find_log as _find_log

    job = tmp_path / "job.py"
    job.write_text(JOB)
    log_path = tmp_path / "train.log"
    marker = tmp_path / "m"
    p = subprocess.Popen([sys.executable, str(job), str(tmp_path / "o"), str(marker), str(log_path)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        _wait_file(marker)
        log, how = _find_log(_host(), p.pid)
        assert log == str(log_path) and "append" in how
    finally:
        p.kill()
        p.wait()


def test_url_from_the_listen_address() -> None:
    from stallwatch.probes.discover import _url

    assert _url("0.0.0.0", 30000) == "http://127.0.0.1:30000"
    assert _url("::", 30000) == "http://127.0.0.1:30000"
    assert _url("127.0.0.5", 8) == "http://127.0.0.5:8"
    assert _url("10.1.2.3", 30000) == "http://10.1.2.3:30000"
    assert _url("fe80::1", 1) == "http://[fe80::1]:1"
