"""The launch model's shape (no torch: train.py checks its flags before importing torch).

Format shape rules (MXFP8 blocks of 32, NVFP4 blocks of 16, FP8 128-blocks may be partial) hold on one device when
d_model, the MLP hidden size and the tokens per rank per step are multiples of 32: `ModelConfig.check` says so
before anything is built. Tensor parallelism cuts the projections into pieces whose blocks must stay whole: the
default hidden size is rounded up to a multiple of 256 (Llama's `multiple_of`), which splits into whole blocks for
every preset at --tp 2 and 4 (FP8-block's 128x128 tiles included); train.py's pre-flight checks every split for
the sizes actually asked for (parallel.layout_problems).
"""

from __future__ import annotations

import dataclasses
import math

VOCAB_SIZE = 256  # byte-level: the job trains on raw bytes (data.py)
ALIGN = 32  # the largest 1-D block any preset needs along a GEMM dimension (MXFP8)
HIDDEN_MULTIPLE = 256  # the default SwiGLU hidden size is ~8/3 d_model rounded up to this (Llama's multiple_of)


def default_hidden(d_model: int) -> int:
    return HIDDEN_MULTIPLE * math.ceil(8 * d_model / 3 / HIDDEN_MULTIPLE)


@dataclasses.dataclass
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention when smaller than n_heads
    hidden: int | None = None  # SwiGLU hidden size; default_hidden(d_model) when None
    max_seq: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    moe_experts: int = 0  # > 0: the MLP is a routed mixture of this many SwiGLU experts
    moe_top_k: int = 1  # experts per token

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.hidden is None:
            self.hidden = default_hidden(self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def check(self) -> None:
        """Raise ValueError if a dimension breaks a format rule or the attention layout."""
        problems = []
        for name in ("d_model", "hidden"):
            v = getattr(self, name)
            if v % ALIGN:
                problems.append(f"{name}={v} must be a multiple of {ALIGN} (MXFP8/NVFP4 block sizes)")
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        elif self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (rotary embeddings)")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        elif (self.n_kv_heads * self.head_dim) % ALIGN:
            problems.append(f"n_kv_heads*head_dim={self.n_kv_heads * self.head_dim} must be a multiple of "
                            f"{ALIGN}")
        if self.moe_experts < 0 or (self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts):
            problems.append(f"moe: top_k={self.moe_top_k} must be in [1, experts={self.moe_experts}] (experts >= 0)")
        if problems:
            raise ValueError("model config: " + "; ".join(problems))

    def num_params(self) -> int:
        d, h, kv = self.d_model, self.hidden, self.n_kv_heads * self.head_dim
        mlp = 3 * d * h * max(self.moe_experts, 1) + d * self.moe_experts  # (+ the router)
        block = d * (d + 2 * kv) + d * d + mlp + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head

    def active_params(self) -> int:
        """The parameters one token's forward reads: num_params() less the experts it is not routed to (top-k of
        the experts per layer); num_params() without MoE."""
        idle = max(self.moe_experts - self.moe_top_k, 0)
        return self.num_params() - self.n_layers * 3 * self.d_model * self.hidden * idle

    def shape_line(self) -> str:
        """The model's shape in one line (the job's and the end-to-end report's headers): layers, widths, heads,
        and for an MoE its experts, top-k, expert hidden size, total and active parameters."""
        heads = f"{self.n_heads} heads" + (f" ({self.n_kv_heads} kv)" if self.n_kv_heads != self.n_heads else "")
        if not self.moe_experts:
            return (f"{self.n_layers} layers, d_model {self.d_model}, hidden {self.hidden}, {heads}, "
                    f"{self.num_params() / 1e6:,.1f}M parameters")
        return (f"{self.n_layers} layers, d_model {self.d_model}, {heads}, MoE {self.moe_experts} experts top-"
                f"{self.moe_top_k}, expert hidden {self.hidden}, {self.num_params() / 1e6:,.1f}M parameters "
                f"({self.active_params() / 1e6:,.1f}M active per token)")
