"""The stand-in server's detokenizer process (`sglang::detokenizer`) and its byte-level tokenizer.

Part of the stand-in SGLang server (stallwatch.sglang.protocol_server; docs/sglang-templates.md).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from stallwatch.sglang.procutil import configure_logging, logger, set_pdeathsig, set_process_title


def detokenize(ids: list[int]) -> str:
    """Byte-level: ids below 256 are UTF-8 bytes; others are shown as <|id|>."""
    out, buf = [], bytearray()
    for i in ids:
        if 0 <= i < 256:
            buf.append(i)
        else:
            if buf:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
            out.append(f"<|{i}|>")
    if buf:
        out.append(buf.decode("utf-8", "replace"))
    return "".join(out)


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run_detokenizer_process(args: dict, from_sched: Any, to_front: Any) -> None:
    set_pdeathsig()
    set_process_title("sglang::detokenizer")
    configure_logging(args["log"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    to_front.send(("ready", "detokenizer", {"pid": os.getpid()}))
    while True:
        try:
            _kind, outs = from_sched.recv()
        except EOFError:
            logger.error("Detokenizer: the scheduler closed its connection")
            while True:  # SGLang's detokenizer stays up, waiting on its socket
                time.sleep(3600)
        for o in outs:
            o["text"] = detokenize(o["output_ids"])
        to_front.send(("batch_str_out", outs))


