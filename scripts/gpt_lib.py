"""A small GPT and its data for the demos: the standard library's own Python sources as
byte-level tokens, split into train and validation by file.

Shared by ``train_gpt.py`` and ``compare_precision.py``; the attention softmax, the norms
and the loss go through ``nxd_smp.precision_ops``.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from nxd_smp import precision_ops as P

VOCAB = 256  # bytes


# ---------------------------------------------------------------------------- data
def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, in a fixed order (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    if not files:
        raise SystemExit(f"no .py files under {root}: cannot build the corpus")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation(path: Path, root: Path, percent: int = 10) -> bool:
    digest = hashlib.sha1(path.relative_to(root).as_posix().encode()).digest()
    return digest[0] * 100 // 256 < percent


def load_corpus(max_bytes: int = 8 << 20) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train tokens, validation tokens, stats) as uint8 tensors; each side is capped at
    ``max_bytes`` (files are taken in order, so the split is the same on every machine
    with the same Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = bytearray(), bytearray()
    files = {"train": 0, "val": 0}
    for path in stdlib_files():
        side, buf = ("val", val) if is_validation(path, root) else ("train", train)
        cap = max_bytes if side == "train" else max_bytes // 8
        if len(buf) >= cap:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        buf += data[: cap - len(buf)] + b"\n"
        files[side] += 1
    stats = {"root": str(root), "train_bytes": len(train), "val_bytes": len(val), "files": files}
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), stats


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int):
    """Endless random windows ``(x, y)`` of int64 tokens, ``y`` shifted by one."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        window = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()]).long()
        yield window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------- model
@dataclass(frozen=True)
class GPTConfig:
    layers: int = 3
    width: int = 128
    heads: int = 4
    seq: int = 128

    def __post_init__(self):
        if min(self.layers, self.width, self.heads, self.seq) < 1 or self.width % self.heads:
            raise ValueError(f"bad model shape {self}: all positive, width divisible by heads")


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return P.rms_norm(x, self.weight)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = RMSNorm(cfg.width), RMSNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.up = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.down = nn.Linear(4 * cfg.width, cfg.width, bias=False)

    def forward(self, x, causal):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2)
        attn = P.softmax(scores, scale=1.0 / math.sqrt(c // self.heads), mask=causal[:t, :t])
        y = (attn @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.width)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB, bias=False)
        self.register_buffer("causal", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).tril(), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, self.causal)
        return self.head(self.norm(x))

    def loss(self, idx, targets):
        return P.cross_entropy(self.forward(idx), targets)


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, device, batch: int, iters: int, seed: int = 1234) -> float:
    """Mean validation loss over ``iters`` fixed random batches."""
    model.eval()
    it = batches(tokens, batch, model.cfg.seq, seed)
    total = 0.0
    for _ in range(iters):
        x, y = next(it)
        total += float(model.loss(x.to(device), y.to(device)))
    model.train()
    return total / iters
