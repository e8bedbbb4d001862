"""SGLang's process titles in every shape upstream writes them (docs/upstream.md §3)."""

from __future__ import annotations

import pytest

from stallwatch.sglang.titles import SERVER_CMDLINE, SGLANG_TITLE, parse_title


@pytest.mark.parametrize("title, label, key", [
    ("sglang::scheduler", "TP0", (0, 0, 0, 0, 0, 0)),
    ("sglang::scheduler_TP3", "TP3", (0, 0, 0, 0, 3, 0)),
    # current order (0.5.6+): DP, PP, ATTN_CP, MOE_DP, TP, EP
    ("sglang::scheduler_DP1_PP0_ATTN_CP1_MOE_DP0_TP2_EP2", "DP1_PP0_ATTN_CP1_MOE_DP0_TP2_EP2",
     (1, 0, 1, 0, 2, 2)),
    ("sglang::scheduler_DP0_TP2_EP2", "DP0_TP2_EP2", (0, 0, 0, 0, 2, 2)),
    # 0.5.0-0.5.5 order: DP, TP, EP, PP — the same rank, the same key
    ("sglang::scheduler_DP0_TP2_EP2_PP1", "DP0_PP1_TP2_EP2", (0, 1, 0, 0, 2, 2)),
    ("sglang::scheduler_DP0_PP1_TP2_EP2", "DP0_PP1_TP2_EP2", (0, 1, 0, 0, 2, 2)),
])
def test_scheduler_titles_in_both_orders(title: str, label: str, key: tuple) -> None:
    t = parse_title(title)
    assert t is not None and t.role == "scheduler"
    assert t.label == label and t.key == key


def test_ep_and_dp_ranks_do_not_collapse() -> None:
    """The old code read the number after the last `_TP`: with EP every rank printed as TP0 (the
    EP part follows) and DP groups collided. Ranks keyed by the tuple stay distinct."""
    titles = [f"sglang::scheduler_DP{d}_TP{t}_EP{t}" for d in (0, 1) for t in range(4)]
    keys = {parse_title(x).key for x in titles}
    assert len(keys) == 8
    assert [parse_title(x).tp for x in titles[:4]] == [0, 1, 2, 3]
    old = [int(t) if (t := x.rsplit("_TP", 1)[1]).isdigit() else 0 for x in titles]
    assert len(set(old)) == 1  # what stallwatch used to see


@pytest.mark.parametrize("title, role", [
    ("sglang::detokenizer", "detokenizer"),
    ("sglang::data_parallel_controller", "data_parallel_controller"),
    ("sglang::tokenizer_worker:4242", "tokenizer_worker"),
    ("sglang::detokenizer_router", "detokenizer_router"),
])
def test_other_titles(title: str, role: str) -> None:
    t = parse_title(title)
    assert t is not None and t.role == role and SGLANG_TITLE.match(title)
    assert SERVER_CMDLINE.search(title)
    if role == "tokenizer_worker":
        assert t.worker_of == 4242


@pytest.mark.parametrize("text", ["sglang::schedulerX", "sglang::scheduler_XX1", "python train.py",
                                  "sglang::scheduler_TP", ""])
def test_not_a_title(text: str) -> None:
    assert parse_title(text) is None


@pytest.mark.parametrize("cmdline, is_server", [
    ("/usr/bin/python3 -m sglang.launch_server --model-path m --port 30000", True),
    ("/opt/venv/bin/sglang serve --model-path m --port 30000", True),
    ("sglang serve --model-path m", True),
    ("python -m stallwatch.sglang.protocol_server --port 0", True),
    ("python extract.py --server http://127.0.0.1:30000 --sglang serve-later", False),
    ("vim sglang_serve.py", False),
])
def test_server_command_lines(cmdline: str, is_server: bool) -> None:
    assert bool(SERVER_CMDLINE.search(cmdline)) is is_server
