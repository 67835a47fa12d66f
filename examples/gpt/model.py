"""A small GPT-style language model: token + position embeddings, pre-norm blocks with
causal self-attention and an MLP, dropout everywhere a real one has it, tied head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab: int = 64
    ctx: int = 16
    d_model: int = 32
    heads: int = 2
    layers: int = 2
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.mlp = nn.Sequential(nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(),
                                 nn.Linear(4 * c.d_model, c.d_model), nn.Dropout(c.dropout))
        self.drop = nn.Dropout(c.dropout)
        self.heads = c.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.ctx, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if weights is None:
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        per_token = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), reduction="none")
        return (per_token.view(idx.shape).mean(1) * weights).mean()  # per-sample loss weights


class TokenWindows(torch.utils.data.Dataset):
    """Windows over a fixed synthetic corpus (a noisy repeating pattern, so there is
    something to learn). Each item is (index, input, target)."""

    def __init__(self, n: int, ctx: int, vocab: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.arange(n + ctx + 1) % (vocab // 2)
        noise = torch.randint(0, vocab, (n + ctx + 1,), generator=g)
        keep = torch.rand(n + ctx + 1, generator=g) < 0.8
        self.corpus = torch.where(keep, base, noise)
        self.n, self.ctx = n, ctx

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        w = self.corpus[i: i + self.ctx + 1]
        return i, w[:-1], w[1:]
