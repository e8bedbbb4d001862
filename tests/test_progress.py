"""Progress, traceback and fatal-line recognition on literal lines as real tools print them."""

from __future__ import annotations

import re

import pytest

from stallwatch.probes.text.progress import (
    ProgressEvent, ProgressParser, TracebackTracker, clean_line, compile_progress_regex,
    exception_line, fatal_kind, is_traceback_start, parse_fraction, parse_progress, parse_tqdm,
)

SPECFORGE = (
    "Generating Hidden States:  49%|████▉     | 18380/37312 "
    "[4:58:10<5:07:01,  1.03it/s, processed=18380, skipped=0, pending_io=2]"
)


def test_specforge_bar_with_postfix():
    ev = parse_progress(SPECFORGE)
    assert ev == ProgressEvent(
        done=18380, total=37312, rate_per_s=1.03, elapsed_s=4 * 3600 + 58 * 60 + 10,
        remaining_s=5 * 3600 + 7 * 60 + 1, source="tqdm",
        postfix={"processed": 18380, "skipped": 0, "pending_io": 2},
        desc="Generating Hidden States", unit="it",
    )
    assert isinstance(ev.done, int)  # JSON shows 18380, not 18380.0


@pytest.mark.parametrize(
    "line, done, total, rate, elapsed, remaining",
    [
        ("  0%|          | 0/100 [00:00<?, ?it/s]", 0, 100, None, 0.0, None),
        ("100%|██████████| 5/5 [00:10<00:00,  2.00s/it]", 5, 5, 0.5, 10.0, 0.0),
        (" 45%|####5     | 45/100 [01:02:03<1:15:00, 12.34s/it]", 45, 100, 1 / 12.34, 3723.0, 4500.0),
        ("Processing: 1234it [00:05, 246.80it/s]", 1234, None, 246.8, 5.0, None),
        ("1234it [00:05, ?it/s]", 1234, None, None, 5.0, None),
        (" 10%|█         | 18.4k/184k [00:10<01:30, 1.84kit/s]", 18400, 184000, 1840.0, 10.0, 90.0),
        ("Downloading: 100%|██████████| 1.23G/1.23G [01:02<00:00, 19.8MB/s]", 1_230_000_000,
         1_230_000_000, 19.8e6, 62.0, 0.0),
        ("train:  3%|▎         | 300/10000 [125:03:04<4:02:01, 1.5ks/it]", 300, 10000, 1 / 1500, 450184.0, 14521.0),
        ("eval:  50%|#####     | 50/100 [00:10<00:10,  4.99samples/s]", 50, 100, 4.99, 10.0, 10.0),
    ],
)
def test_tqdm_forms(line, done, total, rate, elapsed, remaining):
    ev = parse_tqdm(line)
    assert ev is not None and ev.source == "tqdm"
    assert (ev.done, ev.total, ev.elapsed_s, ev.remaining_s) == (done, total, elapsed, remaining)
    assert ev.rate_per_s == (pytest.approx(rate) if rate is not None else None)


def test_tqdm_unit_and_scaled_bytes():
    ev = parse_tqdm("model.bin:  12%|█▏        | 1.20G/10.0G [00:30<03:40, 40.0MB/s]")
    assert ev.unit == "B" and ev.done == 1_200_000_000 and ev.rate_per_s == 40e6


def test_tqdm_postfix_with_brackets_and_floats():
    ev = parse_tqdm("50%|#| 5/10 [00:05<00:05, 1.00it/s, loss=0.123, lst=[1, 2], name=x]")
    assert ev.postfix == {"loss": 0.123, "lst": "[1, 2]", "name": "x"}


def test_tqdm_set_postfix_str_is_not_a_dict():
    ev = parse_tqdm("50%|#| 5/10 [00:05<00:05, 1.00it/s, warming up]")
    assert ev.done == 5 and ev.postfix == {}


def test_tqdm_bar_cut_mid_write_is_not_progress():
    # A bar whose closing bracket has not been written yet could carry a cut number.
    assert parse_tqdm("50%|#| 5/10 [00:05<00:05, 1.00it/s, processed=1") is None


def test_tqdm_with_ansi_and_rank_prefix():
    raw = "\x1b[A[rank0]: Gen:  1%|          | 1/100 [00:01<01:39,  1.00it/s]\x1b[K"
    ev = parse_progress(clean_line(raw))
    assert ev is not None and ev.done == 1 and ev.total == 100


def test_tqdm_carriage_return_stream():
    # What a redirected tqdm leaves in a file: every redraw behind a \r, a \n at close.
    stream = "".join(
        f"\rGen:  {i * 10}%|{'#' * i}| {i}/10 [00:{i:02d}<00:{10 - i:02d},  1.00it/s]" for i in range(11)
    ) + "\n"
    parser = ProgressParser()
    events = [parser.parse(clean_line(x)) for x in re.split(r"[\r\n]", stream) if x]
    assert [e.done for e in events] == list(range(11))
    assert all(e.total == 10 and e.source == "tqdm" for e in events)


@pytest.mark.parametrize(
    "line, done, total",
    [
        ("sample 18380/37312", 18380, 37312),
        ("[18380/37312] wrote data_18380.ckpt", 18380, 37312),
        ("Epoch 3/10", 3, 10),
        ("epoch 3/10 step 500/1000 loss 0.2", 500, 1000),  # the largest total: the inner loop
        ("processed 1,234/5,678 rows", 1234, 5678),
        ("step: 50 / 100", 50, 100),
        ("(7/7) done", 7, 7),
        ("step=50/100", 50, 100),
    ],
)
def test_fraction(line, done, total):
    ev = parse_progress(line)
    assert ev is not None and ev.source == "fraction"
    assert (ev.done, ev.total) == (done, total)


@pytest.mark.parametrize(
    "line",
    [
        "2024/11/29 12:00:00 INFO starting",
        "11/29/2024 started",
        "writing /data/hs/rows_0-2000/data_12.ckpt",
        "loading /data/3/10",
        "run-1/2 begins",
        "subnet 10.0.0.0/24",
        "ratio 0.5/1.0",
        "HTTP/1.1 200 OK",
        "GET http://127.0.0.1:30000/generate",
        "retry 12/3",  # done > total: not a counter
        "0/0 items",  # no total
        "x86_64/123",
        "Decode batch, #running-req: 3, #token: 1234, gen throughput (token/s): 123.4, #queue-req: 0",
        "no slash at all 18380 37312",
    ],
)
def test_fraction_false_positives(line):
    assert parse_progress(line) is None


def test_fraction_only_on_demand_helper():
    assert parse_fraction("a 1/2 b").done == 1


def test_user_regex():
    p = ProgressParser(r"wrote sample (?P<done>\d+) of (?P<total>\d+) \((?P<shard>\w+)\)")
    ev = p.parse("12:00 wrote sample 42 of 1000 (s3)")
    assert ev == ProgressEvent(done=42, total=1000, source="regex", postfix={"shard": "s3"})
    # A user regex replaces the built-ins: a tqdm bar is not progress for this log.
    assert p.parse(SPECFORGE) is None


def test_user_regex_done_only_and_thousands():
    ev = ProgressParser(r"rows=(?P<done>[\d,]+)").parse("rows=1,234,567")
    assert ev.done == 1234567 and ev.total is None


def test_user_regex_non_numeric_match_is_not_progress():
    assert ProgressParser(r"state=(?P<done>\w+)").parse("state=loading") is None


@pytest.mark.parametrize(
    "pattern, needle",
    [
        (r"(?P<done>\d+", "does not compile"),
        (r"(\d+)/(\d+)", "no named group 'done'"),
        (r"(?P<total>\d+)", "named groups: total"),
        (r"[", "does not compile"),
    ],
)
def test_bad_regex_is_a_clear_value_error(pattern, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        compile_progress_regex(pattern)
    with pytest.raises(ValueError):
        ProgressParser(pattern)


def test_clean_line_strips_controls():
    assert clean_line("a\x00b\x07c\x1b[31mred\x1b[0m  \t") == "abcred"
    assert clean_line("tab\tkept") == "tab\tkept"


# --- crash text ------------------------------------------------------------------------------

CUDA_TB = """\
Traceback (most recent call last):
  File "/w/scripts/prepare_hidden_states.py", line 412, in <module>
    main()
  File "/w/scripts/prepare_hidden_states.py", line 380, in main
    hidden = model(input_ids)
             ^^^^^^^^^^^^^^^^
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.
"""


def feed(tr: TracebackTracker, text: str) -> None:
    for line in text.splitlines():
        tr.feed(line)


def test_traceback_block_with_multiline_message():
    tr = TracebackTracker()
    feed(tr, "Gen: 1/2\n" + CUDA_TB)
    tb = tr.current
    assert tb is not None and tr.seen == 1
    assert tb.lines[0] == "Traceback (most recent call last):"
    assert tb.exception == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert tb.exception_type == "RuntimeError"
    assert tb.lines[-1].startswith("Compile with")


def test_chained_traceback_keeps_final_exception():
    tr = TracebackTracker()
    feed(tr, """\
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in <module>
ValueError: bad
""")
    tb = tr.current
    assert tr.seen == 1 and tb.exception == "ValueError: bad"
    assert any("During handling" in x for x in tb.lines)


def test_torchrun_prefixed_traceback_and_bare_exception():
    tr = TracebackTracker()
    feed(tr, """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 9, in <module>
[rank0]:     loop()
[rank0]: KeyboardInterrupt
""")
    assert tr.current.exception == "KeyboardInterrupt"


def test_interleaved_noise_inside_frames_is_ignored():
    tr = TracebackTracker()
    feed(tr, """\
Traceback (most recent call last):
  File "a.py", line 1, in <module>
some other writer says hello
    f()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
""")
    tb = tr.current
    assert tb.exception_type == "torch.OutOfMemoryError"
    assert "some other writer says hello" not in tb.lines


def test_huge_traceback_is_bounded():
    tr = TracebackTracker()
    tr.feed("Traceback (most recent call last):")
    for i in range(5000):
        tr.feed(f'  File "r.py", line {i}, in f')
    tr.feed("RecursionError: maximum recursion depth exceeded")
    tb = tr.current
    assert len(tb.lines) <= tr.HEAD + tr.TAIL and tb.omitted_lines > 4000
    assert tb.lines[-1].startswith("RecursionError")


def test_reset_forgets_block():
    tr = TracebackTracker()
    feed(tr, CUDA_TB)
    tr.reset()
    assert tr.current is None and tr.seen == 1


def test_traceback_start_and_exception_line():
    assert is_traceback_start("2024-11-29 12:00:00 ERROR Traceback (most recent call last):")
    assert not is_traceback_start("no traceback here")
    assert exception_line("ValueError: bad value") == ("ValueError", "bad value")
    assert exception_line("[rank3]: torch.distributed.DistBackendError: NCCL error")[0] == (
        "torch.distributed.DistBackendError"
    )
    assert exception_line("Processing item 5") is None


@pytest.mark.parametrize(
    "line, kind",
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB", "cuda_oom"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda_error"),
        ("RuntimeError: CUDA error: device-side assert triggered", "cuda_error"),
        ("[rank1]:[E1129 12:00:00 ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: "
         "WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", "nccl"),
        ("torch.distributed.DistBackendError: NCCL error in: ../nccl.cpp:1, unhandled system error", "nccl"),
        ("node1:123:456 [0] NCCL WARN Cuda failure 'out of memory'", "nccl"),
        ("Killed", "killed"),
        ("./run.sh: line 12:  4242 Killed                  python extract.py", "killed"),
        ("RuntimeError: DataLoader worker (pid 99) is killed by signal: Killed.", "killed"),
        ("Segmentation fault (core dumped)", "segfault"),
        ("Bus error (core dumped)", "bus_error"),
        ("Fatal Python error: Aborted", "python_fatal"),
        ("terminate called after throwing an instance of 'c10::Error'", "abort"),
        ("OSError: [Errno 28] No space left on device", "disk_full"),
        ("OSError: [Errno 5] Input/output error", "io_error"),
        ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "child_failed"),
        ("MemoryError", "oom"),
        ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)", "nccl"),
        ("Fatal signal SIGABRT received", "abort"),
        ("exitcode  : -9 (pid: 1234)", "killed"),
    ],
)
def test_fatal_kinds(line, kind):
    assert fatal_kind(line) == kind


def test_every_fatal_kind_is_tested():
    from stallwatch.probes.text.progress import _FATAL

    tested = {k for _, k in test_fatal_kinds.pytestmark[0].args[1]}
    assert tested == {k for k, _ in _FATAL}


@pytest.mark.parametrize(
    "line",
    [
        "NCCL INFO Bootstrap : Using eth0",
        "killed 3 stale workers? no: skipped",
        "Prefill batch, #new-seq: 1",
        SPECFORGE,
    ],
)
def test_not_fatal(line):
    assert fatal_kind(line) is None


def test_event_json_round_trip():
    ev = parse_progress(SPECFORGE)
    again = ProgressEvent.model_validate_json(ev.model_dump_json())
    assert again == ev and isinstance(again.done, int) and again.postfix["processed"] == 18380


def test_counters_too_big_for_a_float_are_not_progress():
    """Found by fuzzing: `10e308` matched a user regex and read as done = inf; a tqdm counter of
    400 digits too. Neither is a counter: no event, rather than an infinite one."""
    import re as _re

    from stallwatch.probes.text.progress import parse_regex, parse_tqdm

    assert parse_regex("10e308", _re.compile(r"(?P<done>[\d.e+-]+)")) is None
    assert parse_tqdm("x: 10%|#| " + "9" * 400 + "/" + "9" * 401 + " [00:01<00:02, 1.00it/s]") is None
    assert parse_tqdm("x: 10%|#| 5/10 [00:01<00:02, 1.00it/s]").done == 5


@pytest.mark.parametrize("line", [
    SPECFORGE, "  0%|          | 0/100 [00:00<?, ?it/s]", "100%|██████████| 5/5 [00:10<00:00,  2.00s/it]",
    "Processing: 1234it [00:05, 246.80it/s, loss=0.5]", "1234it [00:05, ?it/s]",
    " 10%|█         | 18.4k/184k [00:10<01:30, 1.84kit/s]", "x: 1%| | 1/100 [00:01<00:99, 1.00it/s, lst=[1, 2], f=2.5]",
    "epoch 3/10 step 500/1000 loss 0.2", "processed 1,234/5,678 rows",
])
def test_unvalidated_events_equal_their_validation(line):
    """The parsers build events without validation (issue 17): validating the same fields gives
    an equal event, the same fields set, the same types and the same JSON."""
    ev = parse_progress(line)
    assert ev is not None
    again = ProgressEvent(**{n: getattr(ev, n) for n in ev.model_fields_set})
    assert ev == again and ev.model_fields_set == again.model_fields_set
    assert {n: type(getattr(ev, n)) for n in ProgressEvent.model_fields} == \
        {n: type(getattr(again, n)) for n in ProgressEvent.model_fields}
    assert ev.model_dump_json() == again.model_dump_json()
    assert list(ev.__dict__) == list(again.__dict__)  # the declared order: dumps and repr


def test_interval_fast_path_reads_as_the_regex_does():
    """_interval reads MM:SS and H:MM:SS without its regex: every spelling below gives what the
    regex alone gave (a cut, spaced, day-prefixed or non-ASCII one falls to the regex)."""
    from stallwatch.probes.text import progress as p

    def by_regex(text):
        if not text or text.strip() == "?":
            return None
        m = p._INTERVAL.fullmatch(text)
        if not m:
            return None
        d, h, mi, s = (int(g) if g else 0 for g in m.groups())
        return float(((d * 24 + h) * 60 + mi) * 60 + s)

    for text in ["00:00", "03:24", "5896:18:44", "1:02:03", "125:03:04", "1:2:3", "01:2", "1:234",
                 "12", ":12", "1::12", "1:02:03:04", " 03:24", "03:24 ", "2d, 1:02:03", "2d 03:24",
                 "?", "", "٣:٢٤", "³:24", "03:2x", "-1:00", "1.5:00", "1:00:00:00", "0:00:00"]:
        assert p._interval(text) == by_regex(text), text


@pytest.mark.parametrize("rate", ["4.71it/s", "?it/s", "2.00s/it", "1.84kit/s", " 19.8MB/s", "x y z", ""])
@pytest.mark.parametrize("postfix", ["", ", processed=977, skipped=0", ", lst=[1, 2], f=2.5", ",", ", a]b"])
def test_the_greedy_rate_matches_as_the_lazy_one_did(rate, postfix):
    """The r_bar's rate group is greedy now: the same match, groups included, as the lazy one."""
    import re

    from stallwatch.probes.text import progress as p

    lazy = re.compile(p._TQDM_TOTAL.pattern.replace(r"(?P<rate>[^,\]]*)", r"(?P<rate>[^,\]]*?)"))
    assert lazy.pattern != p._TQDM_TOTAL.pattern
    for line in (f"d:  1%| | 977/1000 [03:24<56:20, {rate}{postfix}]", f"977/1000 [03:24<?, {rate}{postfix}] tail]",
                 f"977/1000 [03:24<56:20, {rate}{postfix}"):
        a, b = p._TQDM_TOTAL.search(line), lazy.search(line)
        assert (a and (a.span(), a.groupdict())) == (b and (b.span(), b.groupdict())), line


def test_num_fast_path_reads_as_the_float_path_does():
    """A plain count of up to 15 ASCII digits is int() at once: float() holds it exactly, so the
    answer is what the float path gave; longer ones (rounded by float) and others take that path."""
    from stallwatch.probes.text import progress as p

    for text in ["0", "977", "0012", "999999999999999", "9007199254740993", "12345678901234567891",
                 "١٢", "1,234", "18.4k", " 12", "12 "]:
        t = text.strip().replace(",", "").replace("_", "")
        mult = 1.0
        if t and t[-1] in "kMGTPEZY":
            mult, t = p._SI[t[-1]], t[:-1]
        v = float(t) * mult
        want = int(v) if v.is_integer() and abs(v) < 2**63 else v
        got = p._num(text)
        assert got == want and type(got) is type(want), text


@pytest.mark.parametrize("line", [
    SPECFORGE, "  0%|          | 0/100 [00:00<?, ?it/s]", "a/b 1/2 977/1000 [03:24<56:20, 1.0it/s]",
    "x 12.5k/1M [00:01<00:02, 3it/s]", "٣/٤ [00:01<00:02, 3it/s]", "/12/34 [00:01<?, ?it/s]",
    "no slash [00:01<00:02, 1it/s]", "1/2", "[00:01<00:02, 1it/s] 5/6 [00:03<00:04, 2it/s]",
    "k.k.5/6 [00:03<00:04, 2it/s]", "M/6 [00:03<00:04, 2it/s]", "",
])
def test_the_r_bar_search_from_the_first_slash_finds_what_a_whole_search_finds(line):
    """_total_from: no _TQDM_TOTAL match can begin before it, so tqdm_done and _parse_tqdm see
    the same match as a search of the whole line."""
    from stallwatch.probes.text import progress as p

    whole = p._TQDM_TOTAL.search(line)
    start = p._total_from(line)
    cut = p._TQDM_TOTAL.search(line, start) if start >= 0 else None
    assert (whole and (whole.span(), whole.groupdict())) == (cut and (cut.span(), cut.groupdict()))
    hinted = bool(p._TQDM_HINT.search(line)) and "/" in line
    assert whole is None or (hinted and p._TQDM_HINT.search(line, start))


def test_clean_line_skips_the_control_regex_only_where_it_would_remove_nothing():
    """clean_line's isprintable() shortcut: every line below cleans as the regex alone cleans it."""
    from stallwatch.probes.text import progress as p

    for line in ["plain line  ", "tab\there", "nul\x00x", "bel\x07", "del\x7f", "nbsp\xa0 x ", "\x85next",
                 "emoji 🙂 ", "\u2028sep", "\x1b[31mred\x1b[0m\x01", "trailing\r", ""]:
        stripped = p._ANSI.sub("", line) if "\x1b" in line else line
        assert p.clean_line(line) == p._CTRL.sub("", stripped).rstrip(), repr(line)


def test_postfix_split_reads_as_the_regex_does():
    """_postfix splits tqdm's `k=v, k=v` without _POSTFIX_ITEM where that is what the regex reads;
    every spelling below (and random ones of the same alphabet) gives the regex's dict, in its order."""
    import random

    from stallwatch.probes.text import progress as p

    texts = ["processed=977, skipped=0", "a=1", "a=1,b=2", "a=1,  b=2", "a=1 , b=2", "a =1, b= 2",
             " a=1, b=2 ", "a=, b=1", "=1, b=2", "a=1=2, b=3", "a=1, b", "a=1, , b=2", "lst=[1, 2], f=2.5",
             "a=1, a=2", "x", "", " ", ",", ", a=1", "a=1,", "a=1, \tb=2", "a\t=1, b=x y", "\xa0a=1, b=2",
             "k=v, k2=v2, k3=3.5, k4=-1"]
    rng = random.Random(17)
    texts += ["".join(rng.choice("ab= ,\t1") for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    for text in texts:
        want = p._postfix_regex(text.strip()) if text else {}
        got = p._postfix(text)
        assert list(got.items()) == list(want.items()), repr(text)


def test_the_remembered_description_is_the_one_of_the_bar_read():
    """_desc keeps the last l_bar's description: bars of two descriptions read in turn each get
    their own, as _LBAR alone gives it."""
    from stallwatch.probes.text import progress as p

    a = "Generating Hidden States:  49%|████▉     | 18380/37312 [04:58<05:07,  1.03it/s]"
    b = "Finalizing Writes:  10%|█         | 1/10 [00:01<00:09,  1.00it/s]"
    c = " 10%|█         | 1/10 [00:01<00:09,  1.00it/s]"
    for line in [a, b, a, a, c, b, c, c]:
        ev = parse_tqdm(line)
        lbar = p._LBAR.search(line[: line.index("| ", line.index("%|") + 2) + 2])
        assert ev is not None and ev.desc == (lbar["desc"] if lbar and lbar["desc"] else None)
    assert parse_tqdm(a).desc == "Generating Hidden States" and parse_tqdm(c).desc is None


@pytest.mark.parametrize("line", [
    SPECFORGE, "  0%|          | 0/100 [00:00<?, ?it/s]", "a/b 1/2 977/1000 [03:24<56:20, 1.0it/s]",
    "x 12.5k/1M [00:01<00:02, 3it/s]", "1/2 [00:01, 3it/s]", "5/6 [00:03<00:04, 2it/s", "epoch 3/10 step 5/9",
    "/tmp/x 5/6 [00:03<00:04, 2it/s, a=1]", "", "no slash", "1234it [00:05, 246.80it/s]",
])
def test_tqdm_done_reads_what_the_full_parse_reads(line):
    """tqdm_done (no hint search) gives the full parse's done, total and postfix presence, or None
    exactly where parse_tqdm reads no bar with a total."""
    ev = parse_tqdm(line)
    from stallwatch.probes.text.progress import tqdm_done

    want = None if ev is None or ev.total is None else (ev.done, ev.total, bool(ev.postfix))
    assert tqdm_done(line) == want
