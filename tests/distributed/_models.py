"""A small causal transformer and a single-process reference trainer that reproduces FSDP2 data parallelism
exactly: each rank's micro-batch is run (and quantized) separately, gradients are averaged in the same tree as
FSDP2's reduce-scatter / HSDP all-reduce, and the same AdamW updates the fp32 master weights."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import hybridq


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))  # explicit math: deterministic
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)
        self.recompute = False

    def _body(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x):
        if self.recompute:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 67, d: int = 96, heads: int = 3, ffn: int = 384, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(steps: int, ranks: int, accum: int, batch: int = 2, seq: int = 16, vocab: int = 67, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(accum)] for _ in range(ranks)]
            for _ in range(steps)]


def micro_seed(step: int, rank: int, micro: int) -> int:
    return 1000 * step + 10 * rank + micro


def reference_run(init_state, recipe_name: str, batches, *, mesh_shape, lr: float = 1e-2, device="cpu",
                  model_kw=None, backward_override=None, first_step: int = 0):
    """Single-process replay of the FSDP2 run. mesh_shape = (replicas, shards); rank = r * shards + s.
    Returns (losses[step][rank][micro], grads of step 0 {name: fp32}, final master params {name: fp32}).
    first_step: the training step batches[0] is (seeds the micro-batches' random draws as that step did)."""
    model_kw = model_kw or {}
    recipe = hybridq.recipe(recipe_name, backward_override=backward_override)
    master = TinyLM(**model_kw).to(device)
    master.load_state_dict(init_state)
    work = TinyLM(**model_kw).to(device)
    work.load_state_dict(init_state)
    hybridq.convert_linears(work, recipe)
    work.to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, foreach=False)
    reps, shards = mesh_shape
    losses, grads0 = [], None
    for step, per_rank in enumerate(batches):
        with torch.no_grad():
            for pw, pm in zip(work.parameters(), master.parameters()):
                pw.copy_(pm)
        rank_grads, step_losses = [], []
        for rank, micros in enumerate(per_rank):
            acc, rl = None, []
            for m, tok in enumerate(micros):
                tok = tok.to(device)
                torch.manual_seed(micro_seed(first_step + step, rank, m))
                loss = loss_fn(work(tok[:, :-1]), tok[:, 1:])
                loss.backward()
                g = {n: p.grad.float() for n, p in work.named_parameters()}
                acc = g if acc is None else {n: acc[n] + g[n] for n in acc}
                work.zero_grad(set_to_none=True)
                rl.append(loss.detach())
            rank_grads.append(acc)
            step_losses.append(rl)
        losses.append(step_losses)

        def mean(items):
            total = items[0]
            for x in items[1:]:
                total = total + x
            return total / len(items) if len(items) > 1 else total

        full = {}
        for n in rank_grads[0]:
            per_rep = [mean([rank_grads[r * shards + s][n] for s in range(shards)]) for r in range(reps)]
            full[n] = mean(per_rep)
        if step == 0:
            grads0 = {n: g.clone() for n, g in full.items()}
        for n, p in master.named_parameters():
            p.grad = full[n]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads0, {n: p.detach().clone() for n, p in master.named_parameters()}
