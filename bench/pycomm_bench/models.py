"""Models and data for the end-to-end DDP benchmark; nothing is downloaded.

Two workloads, each a :class:`Workload` ``(model, batch_fn, loss_fn)``:

* :func:`char_lm`: a small GPT-style byte-level language model trained on
  real text that ships with Python (the standard library's own ``.py``
  sources). Its gradient is dominated by large matrices, the case where
  gradient compression can pay. Default config (:data:`GPT_DEFAULT`):
  4,902,912 parameters, i.e. a 4.9 M-element float32 gradient (19.6 MB).
* :func:`narrow_mlp`: a deep residual MLP of many narrow layers whose
  gradient is made only of small tensors (each below 65536 elements), the
  case where per-tensor/per-bucket overheads dominate and compression does
  not pay. Default (:data:`MLP_DEFAULT`): 1,073,152 parameters in 256
  tensors.

``batch_fn(rank, step)`` is deterministic: the same (rank, step) gives the
same batch in every process and every run, different ranks and steps give
different batches, so a multi-process run is reproducible and each rank
sees its own data (as in data-parallel training). ``loss_fn(model, batch)``
runs the forward pass and returns the scalar loss.

Example::

    >>> import torch
    >>> model, batch_fn, loss_fn = char_lm("tiny")
    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    >>> loss = loss_fn(model, batch_fn(rank=0, step=0))
    >>> abs(loss.item() - math.log(256)) < 0.5      # starts near ln(vocab)
    True
    >>> loss.backward(); opt.step()
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "GPT_DEFAULT",
    "GPT_TINY",
    "GPT_SMALL",
    "MLPConfig",
    "MLP_DEFAULT",
    "MLP_TINY",
    "CharGPT",
    "NarrowMLP",
    "Workload",
    "stdlib_text",
    "char_lm",
    "narrow_mlp",
    "WORKLOADS",
]

#: Byte-level vocabulary: every byte value is a token. Fixed at 256 (rather
#: than the bytes that happen to occur) so that parameter counts do not depend
#: on which Python's standard library supplied the text.
VOCAB_SIZE = 256

Batch = Tuple[torch.Tensor, torch.Tensor]


class Workload(NamedTuple):
    """A model with its data and loss: ``model, batch_fn, loss_fn = workload``.

    ``batch_fn(rank, step) -> (inputs, targets)``; ``loss_fn(model, batch)``
    -> scalar loss tensor (forward pass included).
    """

    model: nn.Module
    batch_fn: Callable[[int, int], Batch]
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]


def _batch_rng(seed: int, rank: int, step: int) -> np.random.Generator:
    # numpy's SeedSequence hashes the whole (seed, rank, step) triple. Not a
    # torch.Generator: torch's CPU generator keeps only the low 32 bits of its
    # seed, so packing rank and step into one 64-bit seed made ranks collide.
    if rank < 0 or step < 0:
        raise ValueError(f"rank and step must be >= 0, got rank={rank}, step={step}")
    return np.random.default_rng(np.random.SeedSequence([seed, rank, step]))


# ---------------------------------------------------------------- text data


@functools.lru_cache(maxsize=4)
def stdlib_text(n_files: int = 64, max_bytes: int = 2_000_000) -> bytes:
    """Real text that ships with Python: the standard library's own sources.

    The ``n_files`` first ``*.py`` files (sorted by name) directly in
    ``os.path.dirname(os.__file__)``, concatenated in that order and cut to
    ``max_bytes``. Deterministic for a given Python installation (another
    Python version gives other, equally real, text). Cached per arguments.

    Example::

        >>> text = stdlib_text(n_files=4, max_bytes=10_000)
        >>> len(text) > 0 and text == stdlib_text(n_files=4, max_bytes=10_000)
        True
    """
    if n_files < 1 or max_bytes < 1:
        raise ValueError(f"n_files and max_bytes must be >= 1, got {n_files}, {max_bytes}")
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py") and os.path.isfile(os.path.join(root, n)))
    chunks, total = [], 0
    for name in names[:n_files]:
        with open(os.path.join(root, name), "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if not text:
        raise RuntimeError(f"no standard-library sources found in {root}")
    return text


def _text_tokens(n_files: int, max_bytes: int) -> torch.Tensor:
    # Bytes are the tokens (see VOCAB_SIZE); int64 for nn.Embedding.
    return torch.frombuffer(bytearray(stdlib_text(n_files, max_bytes)), dtype=torch.uint8).long()


#: What :func:`text_batch_fn` draws from: the whole text, or its two parts
#: when ``heldout > 0`` (training text first, held-out text after it).
SPLITS = ("train", "heldout")


def text_batch_fn(
    batch_size: int, seq_len: int, seed: int = 0, n_files: int = 64, max_bytes: int = 2_000_000,
    heldout: float = 0.0, split: str = "train",
) -> Callable[[int, int], Batch]:
    """``batch_fn(rank, step) -> (inputs, targets)`` of shape (batch_size, seq_len).

    Each row is a window of the :func:`stdlib_text` bytes at an offset drawn
    from a generator seeded by (seed, rank, step); targets are the inputs
    shifted by one byte (next-byte prediction). With ``heldout`` in (0, 1)
    the text's last ``heldout`` fraction (other source files: the text is
    whole files in name order) is kept out of training: ``split="train"``
    windows lie wholly before it, ``split="heldout"`` windows wholly in it,
    so a held-out loss is measured on text no rank ever trained on.

    Example::

        >>> fn = text_batch_fn(batch_size=2, seq_len=8)
        >>> x, y = fn(0, 0)
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([2, 8]), True)
        >>> ev = text_batch_fn(2, 8, n_files=4, max_bytes=10_000, heldout=0.1, split="heldout")
        >>> ev(0, 0)[0].shape
        torch.Size([2, 8])
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= heldout < 1.0:
        raise ValueError(f"heldout must be in [0, 1), got {heldout}")
    if split == "heldout" and heldout == 0.0:
        raise ValueError("split='heldout' needs heldout > 0")
    tokens = _text_tokens(n_files, max_bytes)
    cut = tokens.numel() - int(heldout * tokens.numel())
    tokens = tokens[:cut] if split == "train" else tokens[cut:]
    n_windows = tokens.numel() - seq_len - 1
    if n_windows < 1:
        raise ValueError(f"{split} text of {tokens.numel()} bytes is too short for seq_len={seq_len}")
    cols = torch.arange(seq_len + 1)

    def batch_fn(rank: int, step: int) -> Batch:
        starts = torch.from_numpy(_batch_rng(seed, rank, step).integers(0, n_windows, (batch_size, 1)))
        rows = tokens[starts + cols]  # (batch_size, seq_len + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    return batch_fn


# ---------------------------------------------------------------- GPT


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`CharGPT`.

    Parameter count (no biases in the head; ``d = d_model``, ``V = vocab_size``,
    ``T = seq_len``, ``L = n_layers``, MLP hidden size ``4d``)::

        V*d + T*d + L*(12*d*d + 13*d) + 2*d + (0 if tie_weights else V*d)
    """

    vocab_size: int = VOCAB_SIZE
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    tie_weights: bool = False

    def num_parameters(self) -> int:
        """The formula above (what ``CharGPT(self)`` has)."""
        d, v, t, n = self.d_model, self.vocab_size, self.seq_len, self.n_layers
        return v * d + t * d + n * (12 * d * d + 13 * d) + 2 * d + (0 if self.tie_weights else v * d)


#: 4,902,912 parameters: 6 blocks of d_model 256, 8 heads, context 128, untied head.
GPT_DEFAULT = GPTConfig()
#: 42,880 parameters: 2 blocks of d_model 32, 2 heads, context 32, untied head (tests).
GPT_TINY = GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=2)
#: 508,992 parameters: 4 blocks of d_model 96, 4 heads, context 128, untied
#: head. The quality study's model (``pycomm-bench quality``): small enough
#: that 4 ranks train it 1000 steps of 512 tokens each in about a minute on
#: these 2 cores, so every method gets the same lr grid and several seeds
#: (a bigger model on fewer tokens would leave the comparison at a handful
#: of runs, or at batch sizes where compression noise dominates).
GPT_SMALL = GPTConfig(seq_len=128, d_model=96, n_layers=4, n_heads=4)


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharGPT(nn.Module):
    """GPT-style causal language model: token + learned position embedding,
    ``n_layers`` pre-LN blocks of causal self-attention and a 4x GELU MLP, a
    final LayerNorm, and a linear head (tied to the token embedding if
    ``tie_weights``). ``forward(idx)`` maps (B, T) int64 tokens, T <=
    seq_len, to (B, T, vocab_size) logits.

    Initialization: normal(0, 0.02) weights, zero biases, so that the initial
    logits are near zero and the initial loss is near ln(vocab_size).

    Example::

        >>> m = CharGPT(GPT_TINY)
        >>> m(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 256])
    """

    def __init__(self, cfg: GPTConfig = GPT_DEFAULT) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of n_heads ({cfg.n_heads})")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    # Same initial weights in every process for a given seed, without
    # disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


#: :func:`char_lm`'s configs by name.
GPT_CONFIGS = {"default": GPT_DEFAULT, "tiny": GPT_TINY, "small": GPT_SMALL}


def char_lm(
    config: Union[str, GPTConfig] = "default", batch_size: int = 8, seed: int = 0, text: Optional[dict] = None,
    **overrides
) -> Workload:
    """The byte-level GPT on standard-library text: ``(model, batch_fn, loss_fn)``.

    ``config``: a name of :data:`GPT_CONFIGS` ("default":
    :data:`GPT_DEFAULT`, 4,902,912 parameters; "tiny": :data:`GPT_TINY`,
    42,880; "small": :data:`GPT_SMALL`, 508,992) or a :class:`GPTConfig`;
    ``overrides`` replace fields (e.g. ``n_layers=2``). Batches are
    ``batch_size`` windows of ``seq_len`` bytes; ``seed`` fixes the initial
    weights (identical for all ranks) and, with (rank, step), the batches;
    ``text``: :func:`text_batch_fn`'s text options (``n_files``,
    ``max_bytes``, ``heldout``: training then draws from the training part).

    Example::

        >>> model, batch_fn, loss_fn = char_lm("tiny", batch_size=4)
        >>> sum(p.numel() for p in model.parameters())
        42880
        >>> loss = loss_fn(model, batch_fn(0, 0)); loss.backward()
    """
    cfg = GPT_CONFIGS[config] if isinstance(config, str) else config
    cfg = replace(cfg, **overrides)
    model = _seeded(seed, lambda: CharGPT(cfg))
    return Workload(model, text_batch_fn(batch_size, cfg.seq_len, seed, **(text or {})), _lm_loss)


# ---------------------------------------------------------------- narrow MLP


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of :class:`NarrowMLP`: ``depth`` residual blocks of width ``width``.

    Parameter count: ``depth * (width*width + 3*width)`` (Linear weight and
    bias, LayerNorm weight and bias), in ``4 * depth`` tensors, the largest
    ``width*width`` elements.
    """

    width: int = 128
    depth: int = 64

    def num_parameters(self) -> int:
        """The formula above (what ``NarrowMLP(self)`` has)."""
        return self.depth * (self.width * self.width + 3 * self.width)


#: 1,073,152 parameters in 256 tensors, none above 16,384 elements.
MLP_DEFAULT = MLPConfig()
#: 2,432 parameters in 32 tensors (tests).
MLP_TINY = MLPConfig(width=16, depth=8)


class NarrowMLP(nn.Module):
    """Deep stack of narrow residual blocks ``x + tanh(Linear(LayerNorm(x)))``:
    many small parameter tensors, so a gradient bucket holds many tensors of
    a few thousand elements (per-tensor costs dominate; compression does not
    pay there). ``forward`` maps (B, width) to (B, width).

    Example::

        >>> NarrowMLP(MLP_TINY)(torch.zeros(3, 16)).shape
        torch.Size([3, 16])
    """

    def __init__(self, cfg: MLPConfig = MLP_DEFAULT) -> None:
        super().__init__()
        self.cfg = cfg
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.width) for _ in range(cfg.depth))
        self.layers = nn.ModuleList(nn.Linear(cfg.width, cfg.width) for _ in range(cfg.depth))
        for lin in self.layers:
            # Small residual branches keep a 64-deep stack well conditioned.
            nn.init.normal_(lin.weight, std=0.5 / math.sqrt(cfg.width * cfg.depth))
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, lin in zip(self.norms, self.layers):
            x = x + torch.tanh(lin(norm(x)))
        return x


def _mse_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def narrow_mlp(
    config: Union[str, MLPConfig] = "default", batch_size: int = 64, seed: int = 0, **overrides
) -> Workload:
    """The many-small-tensors workload: ``(model, batch_fn, loss_fn)``.

    ``config``: "default" (:data:`MLP_DEFAULT`, 1,073,152 parameters),
    "tiny" (:data:`MLP_TINY`, 4,352) or an :class:`MLPConfig`. Data: a
    regression onto a fixed random teacher, ``y = sin(x @ W)`` with ``W``
    drawn from ``seed`` and ``x`` standard normal from (seed, rank, step).

    Example::

        >>> model, batch_fn, loss_fn = narrow_mlp("tiny")
        >>> x, y = batch_fn(0, 0); x.shape
        torch.Size([64, 16])
        >>> loss_fn(model, (x, y)).backward()
    """
    cfg = {"default": MLP_DEFAULT, "tiny": MLP_TINY}[config] if isinstance(config, str) else config
    cfg = replace(cfg, **overrides)
    model = _seeded(seed, lambda: NarrowMLP(cfg))
    teacher = torch.randn(cfg.width, cfg.width, generator=torch.Generator().manual_seed(seed)) / math.sqrt(cfg.width)

    def batch_fn(rank: int, step: int) -> Batch:
        x = torch.from_numpy(_batch_rng(seed, rank, step).standard_normal((batch_size, cfg.width), dtype=np.float32))
        return x, torch.sin(x @ teacher)

    return Workload(model, batch_fn, _mse_loss)


#: Workloads by name, for the benchmark's command line: name -> factory(**kwargs).
WORKLOADS = {
    "char-lm": functools.partial(char_lm, "default"),
    "char-lm-tiny": functools.partial(char_lm, "tiny"),
    "narrow-mlp": functools.partial(narrow_mlp, "default"),
    "narrow-mlp-tiny": functools.partial(narrow_mlp, "tiny"),
}
