"""A small GPT-style decoder: pre-norm RMSNorm, rotary positions, GELU or SwiGLU MLP, tied embeddings, no
biases. The outer algorithms need only ``GPT.blocks`` (the transformer blocks in order) for fragments."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

MLP_KINDS = ("gelu", "swiglu")


@dataclass
class GPTConfig:
    """Shape of the model; ``d_model`` must divide by ``n_heads`` and the head size must be even (RoPE)."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 512
    max_seq_len: int = 256
    mlp: str = "gelu"
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_mlp", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head size {self.d_model // self.n_heads} must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _paper(d: int, d_mlp: int, layers: int, heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=32000, d_model=d, n_layers=layers, n_heads=heads, d_mlp=d_mlp, max_seq_len=1024)


# CPU-sized presets (byte vocabulary) first, then the sizes of the DiLoCo / Streaming DiLoCo papers.
# Layer counts divisible by small P (fragments) are chosen on purpose.
PRESETS: dict[str, GPTConfig] = {
    # micro: for smoke tests and CI on CPUs without bf16 matmul, where Muon's Newton-Schulz (bf16) on tiny's
    # matrices dominates a run; the same four layers, so fragments and per-matrix state look alike.
    "micro": GPTConfig(d_model=64, n_layers=4, n_heads=4, d_mlp=256),
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4, d_mlp=512),
    "small": GPTConfig(d_model=192, n_layers=6, n_heads=6, d_mlp=768),
    "base": GPTConfig(d_model=256, n_layers=12, n_heads=4, d_mlp=1024),
    "35m": _paper(512, 2048, 6, 8),
    "100m": _paper(768, 3072, 9, 12),
    "200m": _paper(1024, 4096, 12, 16),
    "300m": _paper(1280, 5120, 15, 20),
    "500m": _paper(1536, 6144, 18, 24),
    "1b": _paper(2048, 8192, 24, 32),
}


def model_config(name: str, vocab_size: int | None = None, seq_len: int | None = None) -> GPTConfig:
    """A fresh copy of a preset, with the vocabulary and context set by the data when given."""
    if name not in PRESETS:
        raise ValueError(f"unknown --model {name!r}; choose one of: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    return replace(preset, vocab_size=preset.vocab_size if vocab_size is None else vocab_size,
                   max_seq_len=preset.max_seq_len if seq_len is None else seq_len)


def training_bytes(cfg: GPTConfig, batch_size: int, seq_len: int) -> int:
    """About how many bytes one worker needs to train this model, to refuse what cannot fit: weights,
    gradients, AdamW's moments, the outer copy and momentum (4 bytes each) and one batch's activations."""
    d, layers = cfg.d_model, cfg.n_layers
    per_layer = 4 * d * d + (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_mlp
    params = layers * per_layer + cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    activations = batch_size * seq_len * (16 * d * layers + 2 * cfg.vocab_size)
    rope = seq_len * (d // cfg.n_heads)
    return 4 * (6 * params + activations + rope)


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim // 2), computed in fp64 so long contexts stay accurate."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of x (..., T, head_dim) by position-dependent angles, so that q.k
    depends on the positions' difference only."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class ResidualProjection(nn.Linear):
    """A projection back into the residual stream: GPT._init_weights shrinks its init with depth."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = ResidualProjection(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        # SwiGLU keeps gate and up projections in one matmul: fewer, larger GEMMs are faster on CPU.
        self.fc = nn.Linear(cfg.d_model, (2 if self.swiglu else 1) * cfg.d_mlp, bias=False)
        self.proj = ResidualProjection(cfg.d_mlp, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        out: torch.Tensor = self.proj(h)
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin))
        out: torch.Tensor = x + self.drop(self.mlp(self.norm2(x)))
        return out


class GPT(nn.Module):
    """Decoder-only language model; ``blocks`` is the ordered list that fragments are cut from."""

    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Non-persistent: derived from the config, so checkpoints and outer syncs never carry them.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """nanoGPT init; residual projections shrink with depth so the residual stream stays O(1)."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if isinstance(module, ResidualProjection):
                std /= math.sqrt(2 * self.cfg.n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) and, given targets, the mean cross-entropy over all positions."""
        _, t = idx.shape
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.drop(self.tok_emb(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        """Distinct parameters: a tied embedding counts once."""
        return sum(p.numel() for p in self.parameters())
