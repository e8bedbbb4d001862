"""The protocol server (stallwatch.sglang.protocol_server): real processes, real HTTP on loopback.

Sizes are tiny (hidden 16, 2 layers) so the pure-Python model answers in milliseconds; every
wait is on an HTTP answer, a process state or a log line, with a deadline.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from rigs import task_state, wait_for_state, wait_until

from stallwatch.probes.server import parse_metrics
from stallwatch.sglang.protocol_server import ServerProcess
from stallwatch.sglang.protocol_server import launch_server as _launch

TINY = ["--hidden-size", "16", "--num-layers", "2", "--health-timeout-s", "2", "--no-access-log",
        "--device", "python"]


def launch_server(*args, **kw):
    return _launch(*args, die_with_parent=True, **kw)  # no server outlives a killed pytest


def torch_installed() -> bool:
    try:
        import torch  # noqa: F401 - whether it imports is the question
    except Exception:  # noqa: BLE001 - a broken torch install is no torch
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with launch_server([*TINY, "--enable-metrics", "--enable-return-hidden-states",
                        "--chunked-prefill-size", "5", "--device", "python"], log=str(log)) as s:
        yield s


def scrape(s: ServerProcess) -> tuple[dict[str, float], dict[str, float]]:
    code, body = s.request("/metrics", timeout=5)
    assert code == 200
    counters, gauges, _ = parse_metrics(body.decode())
    return counters, gauges


def log_has(s: ServerProcess, text: str) -> bool:
    return text in Path(s.log).read_text(errors="replace")


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


# --------------------------------------------------------------------------------- healthy


def test_process_tree_has_sglang_titles(server):
    kids = server.children()
    assert len(kids["scheduler"]) == 1 and len(kids["detokenizer"]) == 1
    sched, detok = kids["scheduler"][0], kids["detokenizer"][0]
    assert cmdline(sched) == ["sglang::scheduler"]
    assert cmdline(detok) == ["sglang::detokenizer"]
    with open(f"/proc/{sched}/comm") as f:
        assert f.read().strip() == "sglang::schedul"  # comm keeps 15 bytes
    assert "stallwatch.sglang.protocol_server" in " ".join(cmdline(server.pid))


def test_generate_hidden_states_one_prefill_element_then_one_row_per_decode_token(server):
    out = server.generate(list(range(1, 9)), max_new_tokens=3, return_hidden_states=True, rid="r-1")
    meta = out["meta_info"]
    assert meta["id"] == "r-1"
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (8, 3)
    assert len(out["output_ids"]) == 3 and isinstance(out["text"], str)
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["e2e_latency"] >= 0
    hs = meta["hidden_states"]
    # Upstream: the prefill's rows arrive once, as one [8][H] element, even though
    # --chunked-prefill-size 5 ran it as two chunks (5 + 3); then one 1-D row per decode step
    # (the last generated token is never fed back, as in SGLang).
    assert len(hs[0]) == 8 and all(len(row) == 16 for row in hs[0])
    assert len(hs) == 3 and all(len(v) == 16 and isinstance(v[0], float) for v in hs[1:])
    again = server.generate(list(range(1, 9)), max_new_tokens=3, return_hidden_states=True)
    assert again["output_ids"] == out["output_ids"] and again["meta_info"]["hidden_states"] == hs


def test_generate_batch_text_and_no_aux_field(server):
    outs = server.generate([[1, 2, 3], [4, 5]], max_new_tokens=2, return_hidden_states=True)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    assert [len(o["meta_info"]["hidden_states"]) for o in outs] == [2, 2]
    # Upstream has no return_aux_hidden_states / aux_hidden_states (docs/upstream.md §3): not answered
    code, raw = server.request("/generate", "POST", {"text": "hello", "sampling_params": {"max_new_tokens": 1},
                                                     "return_aux_hidden_states": True})
    out = json.loads(raw)
    assert code == 200 and out["meta_info"]["prompt_tokens"] == 5
    assert "aux_hidden_states" not in out["meta_info"] and "hidden_states" not in out["meta_info"]
    code, raw = server.request("/generate", "POST", {"sampling_params": {}})
    assert code == 400 and "input_ids" in json.loads(raw)["error"]["message"]


def test_health_info_ready_and_aliases(server):
    assert server.request("/health")[0] == 200
    assert server.request("/health_generate")[0] == 200
    assert server.request("/ready")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        code, raw = server.request(path)
        assert code == 200 and json.loads(raw)["model_path"] == "tiny"
    for path in ("/server_info", "/get_server_info"):
        code, raw = server.request(path)
        info = json.loads(raw)
        assert code == 200 and info["version"] == "0.5.15" and info["watchdog_timeout"] == 300
        state = info["internal_states"][0]  # upstream's fields; queue lengths are log-only
        assert "last_gen_throughput" in state and "memory_usage" in state and "#queue-req" not in state
    assert server.request("/nope")[0] == 404


def test_metrics_names_labels_and_counters(server):
    _code, body = server.request("/metrics")
    text = body.decode()
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                 "sglang:token_usage", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:num_requests_total", "sglang:e2e_request_latency_seconds_bucket",
                 "sglang:time_to_first_token_seconds_count", "sglang:realtime_tokens_total"):
        assert name in text, name
    # not upstream, or only with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1
    for name in ("sglang:scheduler_idle_seconds", "sglang:forward_execution_seconds"):
        assert name not in text, name
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="tiny",pp_rank="0",tp_rank="0"}' in text
    assert 'mode="decode"' in text and "_created" not in text
    before, _ = scrape(server)
    server.generate([7, 8, 9, 10], max_new_tokens=2)
    after, _ = scrape(server)  # tokenizer-side counters move before the response is sent
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == 4
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 2
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 1
    # scheduler-side counters arrive in its next snapshot
    wait_until(lambda: scrape(server)[0]["sglang:realtime_tokens_total"]
               >= before.get("sglang:realtime_tokens_total", 0) + 5, 10, "the scheduler's token counter")
    # a health check moves realtime_tokens (a 1-token prefill), never the tokenizer's counters
    now, _ = scrape(server)
    assert server.request("/health_generate")[0] == 200
    wait_until(lambda: scrape(server)[0]["sglang:realtime_tokens_total"] > now["sglang:realtime_tokens_total"],
               10, "the health check's token")
    after_health, _ = scrape(server)
    for name in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_requests_total"):
        assert after_health[name] == now[name], name


def test_metrics_absent_without_flag(tmp_path):
    with launch_server([*TINY]) as s:
        assert s.request("/metrics")[0] == 404
        code, raw = s.request("/generate", "POST", {"input_ids": [1], "return_hidden_states": True})
        assert code == 400 and "--enable-return-hidden-states" in json.loads(raw)["error"]["message"]


# ------------------------------------------------------------------------------ faults


def test_sigstop_of_the_scheduler_alone(tmp_path):
    """#33858 / #4191: HTTP alive and /model_info answers; /health_generate and /server_info do
    not; /metrics keeps the last gauges while the counters stop."""
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--enable-metrics", "--forward-delay-s", "0.002",
                        "--decode-log-interval", "1000"], log=str(log)) as s:
        errors: list[BaseException] = []

        def long_generation() -> None:
            try:
                s.generate([1, 2, 3], max_new_tokens=1_000_000, timeout=120)
            except BaseException as e:  # noqa: BLE001 - ends when the server is stopped
                errors.append(e)

        threading.Thread(target=long_generation, daemon=True).start()
        wait_until(lambda: scrape(s)[1].get("sglang:num_running_reqs") == 1, 10, "a running request")
        c0 = scrape(s)[0]["sglang:realtime_tokens_total"]
        wait_until(lambda: scrape(s)[0]["sglang:realtime_tokens_total"] > c0, 10, "decode tokens")

        sched = s.scheduler_pids()[0]
        os.kill(sched, signal.SIGSTOP)
        try:
            wait_for_state(sched, "T", 5)
            assert s.request("/model_info", timeout=2)[0] == 200
            with pytest.raises(TimeoutError):
                s.request("/server_info", timeout=1.5)
            t0 = time.monotonic()
            assert s.request("/health_generate", timeout=10)[0] == 503
            assert 1.5 < time.monotonic() - t0 < 8
            assert log_has(s, "Health check failed. Server couldn't get a response from detokenizer "
                              "for last 2 seconds")
            # Stale: the same gauges (a running request) and counters over a 1 s window.
            counters_a, gauges_a = scrape(s)
            time.sleep(1.0)  # the measurement window itself: nothing may change within it
            counters_b, gauges_b = scrape(s)
            assert gauges_a == gauges_b and gauges_a["sglang:num_running_reqs"] == 1
            assert counters_a == counters_b
        finally:
            os.kill(sched, signal.SIGCONT)
        assert s.request("/health_generate", timeout=10)[0] == 200
        moved = counters_b["sglang:realtime_tokens_total"]
        wait_until(lambda: scrape(s)[0]["sglang:realtime_tokens_total"] > moved, 10,
                   "counters moving again after SIGCONT")
        assert not errors  # the long request was still waiting, not failed


def test_crash_fault_on_current_sglang_takes_the_tree_down(tmp_path):
    """Since #18582 (2026-03-29) the SubprocessWatchdog sees the dead scheduler within a second,
    logs it and SIGQUITs the front, which kills the tree: no zombie front any more."""
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--fault", "crash", "--fault-after-requests", "1"], log=str(log)) as s:
        sched = s.scheduler_pids()[0]
        s.generate([1, 2, 3], max_new_tokens=2)
        s.proc.wait(timeout=15)
        assert s.proc.returncode == -signal.SIGKILL
        assert log_has(s, f"Subprocess scheduler_0 (pid={sched}) crashed with exit code 1. "
                          "Triggering SIGQUIT for cleanup...")
        assert log_has(s, "SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        with pytest.raises(ConnectionRefusedError):
            s.request("/health", timeout=2)


def test_crash_fault_on_0_5_4_leaves_a_zombie_http_server(tmp_path):
    """The old behaviour (#18421), which recorded traces before 2026-03 show."""
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--sglang-version", "0.5.4", "--fault", "crash", "--fault-after-requests", "1"],
                       log=str(log)) as s:
        sched = s.scheduler_pids()[0]
        assert s.generate([1, 2, 3], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2
        wait_until(lambda: task_state(sched) is None, 10, "the scheduler to exit")
        wait_until(lambda: log_has(s, "Child process unexpectedly failed with exitcode=256"), 10,
                   "the front to log the child's exit")
        assert log_has(s, "Scheduler hit an exception") and log_has(s, "RuntimeError: injected fault")
        assert s.scheduler_pids() == [] and s.detokenizer_pid() is not None
        assert s.request("/get_model_info", timeout=2)[0] == 200 and s.request("/model_info")[0] == 404
        assert s.request("/health_generate", timeout=10)[0] == 503
        assert log_has(s, "Health check failed.")
        with pytest.raises(TimeoutError):  # requests now wait forever, as with a dead scheduler
            s.generate([1, 2], timeout=1.0)
        assert s.proc.poll() is None


def test_hang_fault_and_sigusr1_toggle(tmp_path):
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--fault", "hang", "--fault-after-requests", "1"], log=str(log)) as s:
        sched = s.scheduler_pids()[0]
        s.generate([1, 2, 3])
        with pytest.raises(TimeoutError):
            s.generate([1, 2, 3], timeout=1.0)
        assert log_has(s, "Scheduler hang injected")
        assert task_state(sched) in ("S", "R")  # alive and wedged, not stopped
        os.kill(s.pid, signal.SIGUSR1)  # the front forwards it to the scheduler
        assert s.generate([4, 5], max_new_tokens=2, timeout=10)["meta_info"]["completion_tokens"] == 2
        assert log_has(s, "Scheduler hang lifted")
        os.kill(sched, signal.SIGUSR1)  # or straight to the scheduler
        wait_until(lambda: Path(s.log).read_text().count("Scheduler hang injected") == 2, 10,
                   "the second hang")
        with pytest.raises(TimeoutError):
            s.generate([1, 2, 3], timeout=1.0)


def test_exit_fault_takes_the_whole_server_down(tmp_path):
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--fault", "exit", "--fault-after-requests", "1"], log=str(log)) as s:
        try:
            s.generate([1, 2, 3])
        except (http.client.HTTPException, ConnectionError):
            # The fault fires once this request has finished in the scheduler; the tree can be
            # killed before or while the front writes its answer (upstream too): on a loaded
            # machine the client then sees the connection close before the status line
            # (RemoteDisconnected) or between the headers and the body (IncompleteRead: 1 in
            # 300 runs beside three CPU hogs).
            pass
        s.proc.wait(timeout=15)
        assert s.proc.returncode == -signal.SIGKILL  # SGLang's kill_process_tree kills itself too
        # The scheduler's SIGQUIT runs the handler (signum=3), unless the front's main thread
        # is starved past the SubprocessWatchdog's next 1 s poll: then the watchdog, having seen
        # the dead scheduler, runs the same handler first (signum=None), as upstream would.
        assert log_has(s, "SIGQUIT received. signum=3, frame=") or (
            log_has(s, "Subprocess scheduler_0 (pid=") and log_has(s, "SIGQUIT received. signum=None"))
        with pytest.raises(ConnectionRefusedError):
            s.request("/health", timeout=2)


def test_tp2_runs_two_schedulers_in_lockstep(tmp_path):
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--tp", "2", "--enable-return-hidden-states"], log=str(log)) as s:
        scheds = s.scheduler_pids()
        assert [cmdline(p) for p in scheds] == [["sglang::scheduler_TP0"], ["sglang::scheduler_TP1"]]
        out = s.generate([1, 2, 3, 4], max_new_tokens=3, return_hidden_states=True)
        assert len(out["meta_info"]["hidden_states"]) == 3
        assert log_has(s, " TP0] Prefill batch, #new-seq: 1")


@pytest.mark.skipif(not torch_installed(), reason="needs torch (tp ranks run gloo all_reduce on CPU)")
def test_torch_tp2_gloo_and_a_stopped_rank_stalls_rank0(tmp_path):
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--tp", "2", "--device", "cpu", "--enable-return-hidden-states"],
                       log=str(log)) as s:
        out = s.generate([1, 2, 3, 4], max_new_tokens=2, return_hidden_states=True)
        assert len(out["meta_info"]["hidden_states"][0]) == 4
        assert log_has(s, "backend=gloo") and log_has(s, "type=TorchTinyModel")
        follower = s.scheduler_pids()[1]
        os.kill(follower, signal.SIGSTOP)  # rank 0 now waits in all_reduce, like an NCCL hang
        try:
            with pytest.raises(TimeoutError):
                s.generate([5, 6], max_new_tokens=2, timeout=2.0)
            assert s.request("/health_generate", timeout=10)[0] == 503
        finally:
            os.kill(follower, signal.SIGCONT)
        assert s.generate([7, 8], timeout=20)["meta_info"]["completion_tokens"] == 1


# ------------------------------------------------------------------------------ the shapes


@pytest.mark.parametrize("version, titles, new_routes", [
    ("current", ["sglang::scheduler_PP0_TP0_EP0", "sglang::scheduler_PP0_TP1_EP1",
                 "sglang::scheduler_PP1_TP0_EP0", "sglang::scheduler_PP1_TP1_EP1"], True),
    ("0.5.4", ["sglang::scheduler_TP0_EP0_PP0", "sglang::scheduler_TP1_EP1_PP0",
               "sglang::scheduler_TP0_EP0_PP1", "sglang::scheduler_TP1_EP1_PP1"], False),
])
def test_shapes_titles_routes_and_log_prefix(tmp_path, version, titles, new_routes):
    log = tmp_path / "server.log"
    with launch_server([*TINY, "--sglang-version", version, "--tp", "2", "--pp", "2", "--ep", "2"],
                       log=str(log)) as s:
        assert sorted(cmdline(p)[0] for p in s.scheduler_pids()) == sorted(titles)
        assert s.request("/server_info")[0] == (200 if new_routes else 404)
        assert s.request("/model_info")[0] == (200 if new_routes else 404)
        code, raw = s.request("/get_server_info")
        assert code == 200 and json.loads(raw)["version"] == ("0.5.15" if new_routes else "0.5.4")
        s.generate([1, 2, 3])
        prefix = "PP0 TP0 EP0" if new_routes else "TP0 EP0 PP0"
        assert log_has(s, f" {prefix}] Prefill batch")
        # the deprecated name still answers on current SGLang, with a warning per call
        assert log_has(s, "Endpoint '/get_server_info' is deprecated") is new_routes


def test_metrics_at_tp4_with_all_schedulers_report_true_counts(tmp_path):
    """Every TP rank exports its group's gauges: the probe must not multiply them by 4."""
    from stallwatch.probes.server import ServerProbe

    log = tmp_path / "server.log"
    with launch_server([*TINY, "--tp", "4", "--enable-metrics", "--enable-metrics-for-all-schedulers",
                        "--max-running-requests", "1", "--forward-delay-s", "0.01",
                        "--decode-log-interval", "1000"], log=str(log)) as s:
        for _ in range(3):  # one runs, two wait in the queue
            threading.Thread(target=lambda: _ignore(lambda: s.generate([1, 2], max_new_tokens=100_000,
                                                                         timeout=60)), daemon=True).start()
        def text() -> str:
            return s.request("/metrics")[1].decode()

        wait_until(lambda: text().count('sglang:num_queue_reqs{') == 4 and
                   'sglang:num_queue_reqs{engine_type="unified",model_name="tiny",pp_rank="0",tp_rank="3"} 2.0'
                   in text(), 20, "four ranks reporting 2 queued")
        probe = ServerProbe(s.url, collect_wait_s=5)
        m = probe.collect().metrics
        # 2 queued, or 3 once the probe's own /health_generate (started in parallel with the
        # /metrics read) has joined the queue behind the running request, as it does upstream.
        # Summed over the four ranks it would read 8 or 12.
        assert m.gauges["sglang:num_running_reqs"] == 1
        assert m.gauges["sglang:num_queue_reqs"] in (2, 3), m.gauges


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the server is stopped under it at the end
        pass


def test_aux_layers_make_hidden_states_the_capture(tmp_path):
    """An EAGLE-3 target returns its captured layers' concatenation in hidden_states."""
    with launch_server([*TINY, "--enable-return-hidden-states", "--aux-layers", "0,1"]) as s:
        hs = s.generate([1, 2, 3], return_hidden_states=True)["meta_info"]["hidden_states"]
        assert len(hs) == 1 and len(hs[0]) == 3 and len(hs[0][0]) == 2 * 16
