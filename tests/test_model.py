"""The GPT: shapes, parameter count, causality, rotary relativity, tying, and that it learns."""

from __future__ import annotations

import math

import pytest
import torch

from eagerloco.model import GPT, PRESETS, GPTConfig, apply_rotary, model_config, rope_tables

SMALL = GPTConfig(vocab_size=61, d_model=32, n_layers=3, n_heads=4, d_mlp=48, max_seq_len=16)


def closed_form_params(cfg: GPTConfig) -> int:
    d, f, v = cfg.d_model, cfg.d_mlp, cfg.vocab_size
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * f
    block = 4 * d * d + mlp + 2 * d  # qkv + proj, MLP, two RMSNorm weights; no biases
    head = 0 if cfg.tie_embeddings else v * d
    return v * d + cfg.n_layers * block + d + head


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_closed_form(mlp: str, tie: bool) -> None:
    cfg = GPTConfig(**{**SMALL.__dict__, "mlp": mlp, "tie_embeddings": tie})
    assert GPT(cfg).num_params() == closed_form_params(cfg)


def test_output_shapes_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, SMALL.vocab_size) and logits.dtype == torch.float32
    assert loss is None
    _, loss = model(idx, idx)
    assert loss is not None and loss.shape == ()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, SMALL.max_seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_causal(mlp: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL.__dict__, "mlp": mlp})).eval()
    idx = torch.randint(0, SMALL.vocab_size, (2, 12))
    j = 7
    changed = idx.clone()
    changed[:, j] = (changed[:, j] + 1) % SMALL.vocab_size
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :j], b[:, :j])
    assert not torch.allclose(a[:, j:], b[:, j:])


def test_tied_embeddings_share_storage() -> None:
    model = GPT(SMALL)
    assert model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():
        model.tok_emb.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0].item() == 123.0
    untied = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": False}))
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()


def test_rotary_scores_depend_on_relative_position() -> None:
    torch.manual_seed(0)
    head_dim, t = 16, 64
    cos, sin = rope_tables(head_dim, t)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(pq: int, pk: int) -> float:
        x = torch.zeros(2, t, head_dim)
        x[0, pq], x[1, pk] = q, k
        r = apply_rotary(x, cos, sin)
        return float(r[0, pq] @ r[1, pk])

    base = score(10, 3)
    for shift in (1, 5, 40):
        assert score(10 + shift, 3 + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
    assert abs(score(10, 3) - score(10, 9)) > 1e-3  # and they do depend on the distance
    assert float(apply_rotary(q.expand(t, -1), cos, sin).norm(dim=-1).std()) < 1e-4  # a pure rotation


def test_rope_buffers_not_in_state_dict() -> None:
    model = GPT(SMALL)
    assert not any("rope" in k for k in model.state_dict())


def test_deterministic_given_seed() -> None:
    torch.manual_seed(3)
    a = GPT(SMALL).state_dict()
    torch.manual_seed(3)
    b = GPT(SMALL).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_loss_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(model_config("tiny"))
    idx = torch.randint(0, 256, (4, 64))
    _, loss = model(idx, torch.randint(0, 256, (4, 64)))
    assert loss is not None
    assert abs(loss.item() - math.log(256)) < 0.15


def test_init_residual_projections_scaled() -> None:
    torch.manual_seed(0)
    cfg = model_config("tiny")
    model = GPT(cfg)
    expected = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_adamw_lowers_loss_on_repeated_batch() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, SMALL.vocab_size, (4, 16))
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(15):
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("tiny", 0.5e6, 1.0e6),
        ("small", 2.0e6, 4.0e6),
        ("base", 7.5e6, 12.5e6),
        ("35m", 30e6, 40e6),
        ("100m", 80e6, 120e6),
        ("200m", 160e6, 240e6),
        ("300m", 260e6, 360e6),
        ("500m", 450e6, 600e6),
        ("1b", 0.9e9, 1.35e9),
    ],
)
def test_preset_sizes(name: str, low: float, high: float) -> None:
    cfg = model_config(name)
    with torch.device("meta"):  # no memory for the large ones
        model = GPT(cfg)
    n = model.num_params()
    assert low <= n <= high
    assert n == closed_form_params(cfg)
    assert len(model.blocks) == cfg.n_layers >= 4


def test_model_config_overrides_and_copies() -> None:
    cfg = model_config("tiny", vocab_size=1000, seq_len=64)
    assert (cfg.vocab_size, cfg.max_seq_len) == (1000, 64)
    assert PRESETS["tiny"].vocab_size == 256  # the preset itself is untouched


def test_unknown_preset_error() -> None:
    with pytest.raises(ValueError, match=r"--model 'huge'.*tiny.*1b"):
        model_config("huge")


def test_invalid_config_errors() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="mlp"):
        GPTConfig(mlp="relu")


def test_model_uses_rotary_tables() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    idx = torch.randint(0, SMALL.vocab_size, (1, 12))
    a, _ = model(idx)
    model.rope_cos.fill_(1.0)  # angle 0 everywhere: positions no longer rotate q and k
    model.rope_sin.zero_()
    b, _ = model(idx)
    assert torch.allclose(a[:, 0], b[:, 0], atol=1e-6)  # position 0 is never rotated
    assert not torch.allclose(a[:, 1:], b[:, 1:], atol=1e-4)
