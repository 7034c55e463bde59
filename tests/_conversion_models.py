"""Models shared by the conversion tests (not a test module)."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

D = 64  # features


class AttentionBlock(nn.Module):
    """A user block around nn.MultiheadAttention: ff is called, attn.out_proj's weight is read by attn itself."""

    def __init__(self, d: int = D):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ff = nn.Linear(d, d)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        return x + self.ff(a)


class SwiGLU(nn.Module):
    """A SwiGLU feed-forward as torchtitan and the training job write it: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, d: int = 128, h: int = 256):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
