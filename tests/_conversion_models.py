"""Models shared by the conversion tests (not a test module)."""

from __future__ import annotations

import torch.nn as nn

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
