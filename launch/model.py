"""A small Llama-style decoder for the training job: RMSNorm, causal attention through
`F.scaled_dot_product_attention` with rotary position embeddings, a SwiGLU MLP (or, with `moe_experts > 0`, a
routed mixture of SwiGLU experts), tied or untied head.

The mixture of experts (`MoE`) is token-choice top-k: a router (`nn.Linear(d_model, E)`, kept in high precision)
scores every token, each token goes to its k best experts, the tokens are sorted by expert and the experts run
as grouped GEMMs over `[E, out, in]` weights (`Experts`, the hybridq expert protocol: `hybridq.grouped_mm`, so
`apply_hybrid_fsdp` converts them to `GroupedLinear` and FSDP2 gathers them quantized); the outputs are put back
in token order and combined weighted by the router probabilities. The Switch-Transformer load-balancing loss
(E * sum_e fraction of routed slots_e * mean router probability_e) is kept on the module for the trainer.

Every projection is a plain `nn.Linear` (no bias), so `hybridq.apply_hybrid_fsdp` / `convert_linears` can swap
them. The shape (`ModelConfig`, its format shape rules and default sizes) is in model_config.py, which needs no
torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq
from hybridq.nn.compiled_grouped import experts_in_graph
from model_config import ALIGN, ModelConfig  # noqa: F401 (re-exported: the model's shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, seq: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)  # [seq, head_dim/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; rotate interleaved pairs (x0, x1) by the position's angle."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """E SwiGLU experts as `[E, out, in]` weights, computed as grouped GEMMs on tokens sorted by expert (the
    hybridq expert protocol: high precision until apply_hybrid_fsdp / convert_experts converts them)."""

    hybridq_grouped_weights = ("w1", "w3", "w2")

    def __init__(self, num_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, hidden))  # down

    def forward(self, x: torch.Tensor, m_splits: torch.Tensor | list[int]) -> torch.Tensor:
        """x [tokens, d_model] sorted by expert, m_splits the token count of each expert."""
        # under --compile the experts are part of the block's graph where every projection compiles into it
        # (per-tensor FP8 with current scaling: FSDP2's gathered experts enter as handles). The others run eagerly
        # between compiled regions: a GroupedLinear of another recipe is a graph break of its own (three per layer),
        # and the high-precision experts (bf16, torchao) were never checked under torch 2.11's dynamo (on the CPU
        # they read the counts on the host: a graph break per projection)
        if torch.compiler.is_compiling() and not experts_in_graph(self):
            return self._eager_forward(x, m_splits)
        return self._forward(x, m_splits)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor, m_splits: torch.Tensor | list[int]) -> torch.Tensor:
        return self._forward(x, m_splits)

    def _forward(self, x: torch.Tensor, m_splits: torch.Tensor | list[int]) -> torch.Tensor:
        h = F.silu(hybridq.grouped_mm(self, "w1", x, m_splits)) * hybridq.grouped_mm(self, "w3", x, m_splits)
        return hybridq.grouped_mm(self, "w2", h, m_splits)


def route(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-choice top-k dispatch. probs [T, E] (router softmax). Returns (order, token, weight, m_splits):
    `order` sorts the T*k (token, choice) slots by expert (stable: token order within an expert), `token[i]` is the
    token of sorted slot i, `weight[i]` its combine weight (its top-k probabilities renormalised to sum to 1), and
    `m_splits[e]` the slots of expert e (int64 `[E]` on probs' device: no host sync, as torchtitan's router; the
    grouped GEMMs read the counts on the device)."""
    top_p, top_e = probs.topk(top_k, dim=-1)  # [T, k]
    if top_k > 1:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    flat_e = top_e.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    # (not torch.bincount: on CUDA it reads the input's max on the host, a sync per layer). Traced, the counts are
    # summed in int32: inductor lowers an int64 index_add to aten's accumulating index_put (tl.atomic_add takes no
    # int64), a sort-based kernel of ~1.45 ms per layer on an H200 at 16k tokens x top-2; int32 is one atomic-add
    # kernel, and exact (counts < 2^31)
    count = torch.int32 if torch.compiler.is_compiling() else torch.int64
    m_splits = torch.zeros(probs.shape[-1], dtype=count, device=probs.device).index_add_(
        0, flat_e, torch.ones_like(flat_e, dtype=count)).to(torch.int64)
    # (index_select, not `[order]`: the latter's backward is an accumulating index_put, a sort-based kernel of
    # ~1.4 ms per layer on an H200 at 16k tokens x top-2 -- `order` is a permutation, so index_add's backward is
    # exact and deterministic: one contribution per element)
    return order, order // top_k, top_p.reshape(-1).index_select(0, order), m_splits


class DispatchTokens(torch.autograd.Function):
    """`flat[token]`: every routed slot's input row, in the order `route` sorted the slots. Its backward sums each
    token's k slot gradients the way `combine` sums outputs: slots back to (token, choice) order by the permutation
    `order`, then a sum over the k choices -- deterministic, no atomics. (Autograd's own backward of `flat[token]`
    is an accumulating index_put over repeated indices: a sort-based kernel that took ~1.4 ms per MoE layer on an
    H200 at 16k tokens x top-2, more than all the experts' grouped GEMMs of that layer.)"""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, token: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return flat.index_select(0, token)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (order,) = ctx.saved_tensors
        by_token = torch.empty_like(dy).index_copy_(0, order, dy)
        return by_token.view(dy.shape[0] // ctx.top_k, ctx.top_k, -1).sum(1), None, None, None


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weight: torch.Tensor, tokens: int, top_k: int
            ) -> torch.Tensor:
    """Each token's output: the weighted sum of its k experts' outputs (y_sorted in the order `route` sorted the
    slots). Slots go back to (token, choice) order and are summed over the choices: deterministic, no atomics."""
    y = (y_sorted * weight.unsqueeze(-1).to(y_sorted.dtype))
    y = torch.empty_like(y).index_copy_(0, order, y)
    return y.view(tokens, top_k, -1).sum(1)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)  # kept in high precision (routing)
        self.experts = Experts(cfg.moe_experts, cfg.d_model, cfg.hidden)
        self.aux_loss: torch.Tensor | None = None  # the load-balancing loss of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = self.router(flat).float().softmax(-1)  # [T, E]
        order, token, weight, m_splits = route(probs, self.top_k)
        y = self.experts(DispatchTokens.apply(flat, token, order, self.top_k), m_splits)
        out = combine(y, order, weight, flat.shape[0], self.top_k)
        # Switch Transformer: E * sum_e (fraction of slots routed to e) * (mean router probability of e)
        frac = m_splits.float() / max(1, order.numel())
        self.aux_loss = self.num_experts * (frac * probs.mean(0)).sum()
        return out.view(shape).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.moe_experts else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # tied: the head reads the embedding matrix through F.linear (no Linear module to convert)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 n_layers)."""
        std = 0.02
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
            elif p.dim() >= 2 and not name.startswith("tok_embeddings"):
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab]."""
        s = tokens.shape[1]
        if s > self.cfg.max_seq:
            raise ValueError(f"sequence length {s} exceeds max_seq={self.cfg.max_seq}")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight.to(h.dtype))
        return self.output(h)

    def aux_loss(self) -> torch.Tensor | None:
        """The mean load-balancing loss of the MoE layers in the last forward (None without MoE)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        return torch.stack(losses).mean() if losses else None
