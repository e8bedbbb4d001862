"""The tiny model behind the protocol server: torch when installed, pure Python otherwise.

Both backends have one interface (`TinyModel`) and the same shapes: per-request cache, a
`forward` over a chunk of tokens (a prefill chunk, or the one token of a decode step) that
returns the next token and, on request, the final layer's hidden states per position and the
auxiliary hidden states (three layers concatenated, as EAGLE3 training captures them).

torch backend (`backend == "torch"`, on CPU or CUDA): embedding, then `num_layers` blocks of
  a causal "tiny attention" (each position mixes the running mean of all positions up to it,
  kept in the per-request cache like a KV cache) and a GELU MLP, with RMS norms; weights are
  deterministic from the seed. With tensor parallelism the MLP is split Megatron-style (first
  matrix by columns, second by rows) and its partial outputs are summed with
  `torch.distributed.all_reduce` — one real collective per layer per forward step.
  `busy_factor` repeats the forward that many times so a GPU shows utilisation while serving.
  `kv_cache_gb` reserves that much device memory, as SGLang's KV pool holds most of the GPU.

pure-Python backend (`backend == "python"`): the same structure with element-wise (diagonal)
  weights and tanh instead of matrices, values from seeded `random.Random` streams: real
  computation, deterministic, and cheap enough for tests (keep hidden size and layers small).

The two backends compute different numbers for the same input; each is deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

__all__ = ["ModelConfig", "StepOutput", "TinyModel", "PythonTinyModel", "TorchTinyModel",
           "load_model", "default_aux_layers", "resolve_device"]


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """SpecForge's EAGLE3 choice (layers 1, L/2-1, L-4, 0-based), clipped to the stack."""
    picks = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(p, 0), num_layers - 1) for p in picks)


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 256
    num_layers: int = 4
    vocab_size: int = 1024
    seed: int = 0
    ffn_mult: int = 2
    aux_layers: tuple[int, ...] | None = None  # None: default_aux_layers(num_layers)

    def aux(self) -> tuple[int, ...]:
        return self.aux_layers if self.aux_layers is not None else default_aux_layers(self.num_layers)


@dataclass
class StepOutput:
    next_token: int
    # Final layer output per position: [T][H] for a chunk of T tokens, None unless requested.
    hidden: list | None = None
    aux: list | None = None  # [T][len(aux_layers) * H]
    extra: dict = field(default_factory=dict)


class TinyModel:
    backend = "abstract"
    device = "none"

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def new_cache(self) -> Any:
        raise NotImplementedError

    def forward(self, cache: Any, token_ids: Sequence[int], *, return_hidden: bool = False,
                return_aux: bool = False) -> StepOutput:
        raise NotImplementedError

    def describe(self) -> dict:
        c = self.config
        return {"backend": self.backend, "device": self.device, "hidden_size": c.hidden_size,
                "num_layers": c.num_layers, "vocab_size": c.vocab_size, "aux_layers": list(c.aux())}


# ------------------------------------------------------------------------------ pure Python


class _PyCache:
    __slots__ = ("sums", "count")

    def __init__(self, layers: int, hidden: int) -> None:
        self.sums = [[0.0] * hidden for _ in range(layers)]
        self.count = 0


class PythonTinyModel(TinyModel):
    backend = "python"
    device = "python"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        h, n = config.hidden_size, config.num_layers
        self._emb: dict[int, list[float]] = {}
        self._w, self._u, self._b = [], [], []
        for layer in range(n):
            rng = random.Random(config.seed * 7919 + layer + 1)
            self._w.append([rng.uniform(0.5, 1.5) for _ in range(h)])
            self._u.append([rng.uniform(-1.0, 1.0) for _ in range(h)])
            self._b.append([rng.uniform(-0.1, 0.1) for _ in range(h)])

    def _embed(self, tok: int) -> list[float]:
        tok %= self.config.vocab_size
        vec = self._emb.get(tok)
        if vec is None:
            rng = random.Random(self.config.seed * 1_000_003 + tok)
            vec = self._emb[tok] = [rng.uniform(-1.0, 1.0) for _ in range(self.config.hidden_size)]
        return vec

    def new_cache(self) -> _PyCache:
        return _PyCache(self.config.num_layers, self.config.hidden_size)

    def forward(self, cache: _PyCache, token_ids: Sequence[int], *, return_hidden: bool = False,
                return_aux: bool = False) -> StepOutput:
        tanh = math.tanh
        aux_layers = self.config.aux() if return_aux else ()
        hidden_rows, aux_rows = [], []
        x: list[float] = []
        for tok in token_ids:
            x = self._embed(int(tok))
            cache.count += 1
            inv = 1.0 / cache.count
            captured = {}
            for layer, (w, u, b) in enumerate(zip(self._w, self._u, self._b, strict=True)):
                s = cache.sums[layer]
                for i, xi in enumerate(x):
                    s[i] += xi
                # causal mean mixing, then an element-wise tanh block with a residual
                x = [xi + tanh(wi * xi + ui * si * inv + bi) for xi, wi, ui, si, bi in zip(x, w, u, s, b, strict=True)]
                if layer in aux_layers:
                    captured[layer] = x
            if return_hidden:
                hidden_rows.append(x)
            if return_aux:
                row: list[float] = []
                for layer in aux_layers:
                    row.extend(captured[layer])
                aux_rows.append(row)
        h = self.config.hidden_size
        width = min(h, self.config.vocab_size)
        best = max(range(width), key=x.__getitem__) if x else 0
        next_token = (best * 31 + cache.count) % self.config.vocab_size
        return StepOutput(next_token, hidden_rows if return_hidden else None,
                          aux_rows if return_aux else None)


# ----------------------------------------------------------------------------------- torch


def resolve_device(device: str) -> str:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' | 'python' -> the device the model will use.

    auto: cuda when torch sees a GPU, else cpu with torch, else python. cpu without torch falls
    back to python (same interface). cuda without a usable GPU raises RuntimeError.
    """
    if device == "python":
        return "python"
    try:
        import torch
    except Exception:  # noqa: BLE001 - a broken torch install is no torch
        if device.startswith("cuda"):
            raise RuntimeError("--device cuda needs torch, which is not installed") from None
        return "python"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return device


class TorchTinyModel(TinyModel):
    backend = "torch"

    def __init__(self, config: ModelConfig, device: str = "cpu", *, tp_rank: int = 0, tp_size: int = 1,
                 all_reduce: Callable[[Any], None] | None = None, busy_factor: int = 1,
                 kv_cache_gb: float = 0.0) -> None:
        super().__init__(config)
        import torch

        self.torch = torch
        self.device = str(device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.all_reduce = all_reduce if tp_size > 1 else None
        self.busy_factor = max(1, int(busy_factor))
        h, v, n = config.hidden_size, config.vocab_size, config.num_layers
        f = h * config.ffn_mult
        if f % tp_size:
            raise ValueError(f"MLP width {f} is not divisible by tp size {tp_size}")
        shard = f // tp_size
        gen = torch.Generator().manual_seed(config.seed)
        dev = torch.device(self.device)

        def w(*shape: int, scale: float) -> Any:
            return (torch.randn(*shape, generator=gen) * scale)

        # Every rank draws the full weights from the same generator, then keeps its shard: the
        # result does not depend on the tp size (up to float summation order).
        self.emb = w(v, h, scale=1.0).to(dev)
        self.mix, self.up, self.down = [], [], []
        lo, hi = tp_rank * shard, (tp_rank + 1) * shard
        for _ in range(n):
            self.mix.append(w(h, h, scale=0.5 / math.sqrt(h)).to(dev))
            self.up.append(w(h, f, scale=1.0 / math.sqrt(h))[:, lo:hi].contiguous().to(dev))
            self.down.append(w(f, h, scale=0.5 / math.sqrt(f))[lo:hi, :].contiguous().to(dev))
        self.kv_pool = None
        if kv_cache_gb > 0:
            n_elems = int(kv_cache_gb * (1 << 30)) // 2
            self.kv_pool = torch.zeros(n_elems, dtype=torch.bfloat16, device=dev)

    def new_cache(self) -> dict:
        t = self.torch
        h = self.config.hidden_size
        return {"sums": t.zeros(self.config.num_layers, h, device=self.device), "count": 0}

    @staticmethod
    def _rms(x: Any) -> Any:
        return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()

    def _stack(self, cache: dict, ids: Any, capture: Sequence[int]) -> tuple[Any, Any, list]:
        t = self.torch
        x = self.emb[ids]  # [T, H]
        count = cache["count"]
        n_tok = x.shape[0]
        denom = t.arange(count + 1, count + n_tok + 1, device=x.device, dtype=x.dtype)[:, None]
        new_sums = []
        captured = {}
        for layer in range(self.config.num_layers):
            cs = t.cumsum(x, 0) + cache["sums"][layer]
            new_sums.append(cs[-1])
            x = x + (cs / denom) @ self.mix[layer]
            z = t.nn.functional.gelu(self._rms(x) @ self.up[layer]) @ self.down[layer]
            if self.all_reduce is not None:
                self.all_reduce(z)  # sums the MLP shards across tp ranks
            x = x + z
            if layer in capture:
                captured[layer] = x
        return x, t.stack(new_sums), [captured[layer] for layer in capture]

    def forward(self, cache: dict, token_ids: Sequence[int], *, return_hidden: bool = False,
                return_aux: bool = False) -> StepOutput:
        t = self.torch
        with t.no_grad():
            ids = t.tensor([int(i) % self.config.vocab_size for i in token_ids], device=self.device)
            capture = self.config.aux() if return_aux else ()
            for _ in range(self.busy_factor - 1):  # extra work only: keeps a GPU visibly busy
                self._stack(cache, ids, ())
            x, sums, captured = self._stack(cache, ids, capture)
            cache["sums"] = sums
            cache["count"] += len(token_ids)
            logits = self._rms(x[-1]) @ self.emb.T
            next_token = int(logits.argmax().item())
            hidden = x.float().cpu().tolist() if return_hidden else None
            aux = t.cat(captured, dim=-1).float().cpu().tolist() if return_aux else None
        return StepOutput(next_token, hidden, aux)


def load_model(config: ModelConfig, device: str = "auto", *, tp_rank: int = 0, tp_size: int = 1,
               all_reduce: Callable[[Any], None] | None = None, busy_factor: int = 1,
               kv_cache_gb: float = 0.0) -> TinyModel:
    """The model for `device` (see resolve_device); `device` may already be resolved."""
    dev = resolve_device(device)
    if dev == "python":
        return PythonTinyModel(config)
    return TorchTinyModel(config, dev, tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce,
                          busy_factor=busy_factor, kv_cache_gb=kv_cache_gb)
