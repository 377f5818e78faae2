"""Device, precision, compile and MFU: the paths that run here, and the CUDA ones where there is a GPU.

On a CPU (CI): bf16 autocast at a tiny size, torch.compile of a tiny model (one case: compiling costs
tens of seconds), the codecs and the exchange staging on the parameters' device, MFU against its
closed form, and the settings' validation. The tests marked ``cuda`` run only where CUDA is.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import StalledGroup, plain_sgd_outer

from eagerloco.codecs import get_codec
from eagerloco.comm.base import encode, flatten, mean_of_payloads
from eagerloco.comm.inprocess import InProcessGroup
from eagerloco.comm.staging import Staging
from eagerloco.config import ConfigError, OuterConfig, TrainConfig
from eagerloco.device import inner_optimizer, peak_tflops, resolve_device, resolve_precision
from eagerloco.flops import PEAK_TFLOPS, flops_per_token, mfu, peak_for
from eagerloco.model import GPT, GPTConfig
from eagerloco.train.outputs import ProgressLines, add_throughput
from eagerloco.train.worker import Worker, model_flops

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SMALL = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_mlp=64, max_seq_len=16)


class Stream:
    """Fixed random batches, the same for every worker built with the same seed."""

    def __init__(self, seed: int = 0, batch: int = 2, seq: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (8, batch, seq + 1), generator=g)
        self.i = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.data[self.i % len(self.data)]
        self.i += 1
        return b[:, :-1], b[:, 1:]

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, s: dict) -> None:
        self.i = s["i"]


def _worker(cfg: TrainConfig, model_cfg: GPTConfig = SMALL) -> Worker:
    torch.manual_seed(0)
    comm = InProcessGroup(1).communicator(0)
    return Worker(GPT(model_cfg), comm, Stream(), cfg)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(seq_len=16, warmup_steps=0, steps=10, outer=OuterConfig(method="diloco", inner_steps=2), **kw)


def _steps(w: Worker, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        w.forward_backward()
        w.sync.before_inner_step()
        w.optimizer_step()
        w.sync.after_inner_step()
        losses.append(w.last_loss)
    return losses


# -- MFU ---------------------------------------------------------------------------------------------


def test_flops_per_token_is_6n_plus_attention_for_the_models_shape() -> None:
    c, t = SMALL, 16
    d, f, L, v = c.d_model, c.d_mlp, c.n_layers, c.vocab_size
    # Tied embedding once; per block qkv, out projection, MLP in and out, two RMSNorm weights; a final norm.
    n = v * d + L * (3 * d * d + d * d + d * f + f * d + 2 * d) + d
    assert GPT(c).num_params() == n
    assert flops_per_token(n, L, d, t) == 6 * n + 12 * L * d * t
    w = _worker(_cfg())
    assert model_flops(w, w.cfg)["flops_per_token"] == 6 * n + 12 * L * d * t
    with pytest.raises(ValueError):
        flops_per_token(0, L, d, t)


def test_mfu_is_model_flops_over_the_devices_peak() -> None:
    assert mfu(1000.0, 1e9, 1.0) == pytest.approx(1.0)  # 1e12 FLOP/s on a 1 TFLOP/s device
    assert mfu(1000.0, 1e9, 2.0, devices=2) == pytest.approx(0.25)
    assert mfu(1000.0, 1e9, None) is None
    assert peak_for("NVIDIA H100 80GB HBM3", "bf16") == PEAK_TFLOPS["H100"]["bf16"]
    assert peak_for("NVIDIA H100 PCIe", "fp32") == PEAK_TFLOPS["H100 PCIe"]["fp32"]
    assert peak_for("NVIDIA H200", "bf16") == PEAK_TFLOPS["H200"]["bf16"]
    assert peak_for("NVIDIA H200 NVL", "bf16") == PEAK_TFLOPS["H200 NVL"]["bf16"]
    assert peak_for("Some CPU", "fp32") is None
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, "fp32") is None and peak_tflops(cpu, "fp32", 2.5) == 2.5


def test_summary_throughput_from_its_accounting() -> None:
    s = {"tokens": 4000, "workers": 2, "real_wall_s": 2.0, "compute_s": 1.0, "flops_per_token": 1e9,
         "peak_tflops": 4.0}
    add_throughput(s, devices=1)
    assert s["tokens_per_s"] == 2000 and s["inner_tokens_per_s"] == 2000  # 2000 tokens per worker in 1 s
    assert s["mfu"] == pytest.approx(2000 * 1e9 / 4e12) and s["inner_mfu"] == pytest.approx(0.5)
    s["peak_tflops"] = None
    add_throughput(s)
    assert s["mfu"] is None and s["inner_mfu"] is None


def test_a_cpu_run_with_a_given_peak_reports_mfu(tmp_path) -> None:
    from eagerloco.train import train

    # Its own text and the CPU named: the test runs the same on a GPU machine without network.
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox jumps over a dog. " * 300)
    cfg = TrainConfig(model="tiny", batch_size=2, seq_len=32, steps=4, eval_batches=1, log_every=2, workers=2,
                      data=str(tmp_path / "text"), data_dir=str(tmp_path / "cache"), device="cpu",
                      progress=False, out=str(tmp_path / "run"), peak_tflops=0.5,
                      outer=OuterConfig(method="diloco", inner_steps=2))
    s = train(cfg)
    assert s["device_type"] == "cpu" and s["precision"] == "fp32" and s["compile"] is False
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["real_wall_s"])
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * s["flops_per_token"] / 0.5e12)
    assert s["inner_mfu"] == pytest.approx(s["inner_tokens_per_s"] * s["flops_per_token"] / 0.5e12)
    assert 0 < s["mfu"] < 1
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert all('"tokens_per_s"' in ln and '"mfu"' in ln for ln in lines)


def test_progress_lines_show_tokens_per_second_and_mfu(capsys) -> None:
    from eagerloco.comm.base import WorkerStats

    p = ProgressLines("diloco", 10, 0, every_s=0.0)
    p.t0 -= 1.0  # one second ago
    read = []
    p.update(5, lambda: read.append(1) or 2.0, WorkerStats(), tokens=5000, per_token=1e9, peak=10.0)
    out = capsys.readouterr().out
    assert "loss 2.000" in out and "tokens/s" in out and "MFU" in out and read == [1]


# -- precision, compile, device ----------------------------------------------------------------------


def test_auto_precision_is_fp32_on_cpu_and_bf16_on_cuda() -> None:
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")


def test_the_cpu_default_keeps_its_optimizer_and_arithmetic() -> None:
    w = _worker(_cfg())
    assert w.device.type == "cpu" and w.precision == "fp32" and w.forward is w.model
    assert not w.opt.defaults.get("fused")  # the default AdamW: CPU numbers unchanged
    assert not inner_optimizer([torch.nn.Parameter(torch.zeros(2))], torch.device("cpu"), lr=1.0).defaults.get("fused")
    assert w.sync.generator.device.type == "cpu"


def test_bf16_autocast_keeps_fp32_weights_and_outer_copies_and_tracks_fp32() -> None:
    ref = _steps(_worker(_cfg(precision="fp32")), 4)
    w = _worker(_cfg(precision="bf16"))
    with w.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    got = _steps(w, 4)
    assert all(p.dtype == torch.float32 for p in w.model.parameters())  # master weights
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in w.model.parameters())
    assert all(t.dtype == torch.float32 for frag in w.sync.outer for t in frag)  # outer copies
    assert all(s["exp_avg"].dtype == torch.float32 for s in w.opt.state.values())
    assert all(math.isfinite(x) for x in got)
    assert got != ref  # really lower precision
    assert got == pytest.approx(ref, abs=0.05)  # and close to fp32 (loss ~ log 64 = 4.16)


@pytest.mark.slow
@pytest.mark.processes
def test_compile_trains_the_same_parameters_as_eager() -> None:
    """torch.compile of the tiny model on CPU: the inner steps match eager mode, the outer algorithm
    (which sees the plain module) syncs the same parameters. One case: compiling takes a while."""
    torch._dynamo.reset()
    eager = _worker(_cfg())
    compiled = _worker(_cfg(compile=True))
    assert compiled.forward is not compiled.model
    a, b = _steps(eager, 3), _steps(compiled, 3)
    assert b == pytest.approx(a, rel=1e-4)
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    assert "_orig_mod" not in "".join(compiled.model.state_dict())  # checkpoints keep the plain names
    torch._dynamo.reset()


def test_device_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="--precision"):
        replace(TrainConfig(), precision="fp16").validate()
    with pytest.raises(ConfigError, match="--device"):
        replace(TrainConfig(), device="tpu").validate()
    with pytest.raises(ConfigError, match="--peak-tflops"):
        replace(TrainConfig(), peak_tflops=0.0).validate()
    with pytest.raises(ConfigError, match="--compile"):
        replace(TrainConfig(), compile="yes").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            replace(TrainConfig(), device="cuda").validate()


def test_flags_reach_the_config() -> None:
    import argparse

    from eagerloco.flags import add_train_flags, build_train_config

    p = argparse.ArgumentParser()
    add_train_flags(p)
    args = p.parse_args(["--precision", "bf16", "--compile", "--peak-tflops", "3.5", "--device", "cpu",
                         "--outer-backend", "gloo"])
    cfg = build_train_config(args)
    assert (cfg.precision, cfg.compile, cfg.peak_tflops, cfg.device) == ("bf16", True, 3.5, "cpu")
    assert args.outer_backend == "gloo"


# -- exchanges on the parameters' device ----------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp8", "e2m1", "int4"])
def test_staging_on_a_cpu_is_the_encoded_payload_itself(codec: str) -> None:
    c = get_codec(codec)
    x = torch.randn(1000)
    payload, _ = encode(c, flatten([x.clone()]))
    st = Staging(torch.device("cpu"), on_device=False)
    sent, ready = st.send(payload)
    assert ready is None and sent.data_ptr() == payload.data_ptr()
    mean = mean_of_payloads(c, [sent, sent], x.numel())
    back, done = st.received(mean)
    assert done is None and st.deliver(back, done, torch.device("cpu")) is back


def _codec_roundtrip(device: torch.device, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    c = get_codec(codec)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 1e-3
    packed = c.pack(x.to(device))
    assert packed.device.type == device.type  # "cuda" names the current device, cuda:0 here
    out = c.unpack(packed, x.numel())
    assert out.device.type == device.type
    return packed.cpu(), out.cpu()


@cuda
@pytest.mark.parametrize("codec", ["bf16", "fp8", "e2m1", "e3m0", "int8", "int4", "2bit"])
def test_codecs_on_cuda_give_the_cpus_bytes(codec: str) -> None:
    a, b = _codec_roundtrip(torch.device("cpu"), codec), _codec_roundtrip(torch.device("cuda"), codec)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@cuda
@pytest.mark.parametrize(("values", "k", "chunk"), [("2bit", 64, 4096), ("fp32", 300, 1000), ("e2m1", 5, 7)])
def test_the_sparse_exchange_on_cuda_gives_the_cpus_bytes(values: str, k: int, chunk: int) -> None:
    # Positions as indices (64 of 4096), as a mask (300 of 1000), and a short last chunk (5000 = 714 x 7 + 2).
    c = get_codec(values, topk=k, chunk=chunk)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 1e-3
    x[100:110] = x[100]  # ties go to the lower index on both devices
    packed = [c.pack(x.to(d)) for d in (torch.device("cpu"), torch.device("cuda"))]
    assert packed[1].is_cuda and torch.equal(packed[0], packed[1].cpu())
    out = [c.unpack(b, x.numel()) for b in packed]
    assert out[1].is_cuda and torch.equal(out[0], out[1].cpu())
    assert int((out[0] != 0).sum()) <= k * math.ceil(x.numel() / chunk)


@cuda
def test_staging_through_pinned_memory_on_cuda() -> None:
    dev = torch.device("cuda")
    st = Staging(dev, on_device=False)
    payload = torch.arange(1000, dtype=torch.float32, device=dev).view(torch.uint8)
    sent, ready = st.send(payload)
    assert sent.device.type == "cpu" and sent.is_pinned()
    st.before_collective(ready)
    assert torch.equal(sent, payload.cpu())
    back, done = st.received(sent.view(torch.float32) * 2)
    assert back.is_pinned() and done is None
    mean = st.deliver(back, done, dev)
    assert mean.device.type == "cuda" and torch.equal(mean.cpu(), torch.arange(1000, dtype=torch.float32) * 2)


@cuda
def test_a_cuda_worker_defaults_to_bf16_fused_adamw_and_keeps_fp32_outer_state() -> None:
    torch.manual_seed(0)
    w = Worker(GPT(SMALL).cuda(), InProcessGroup(1).communicator(0), Stream(),
               replace(_cfg(), outer=OuterConfig(method="diloco", inner_steps=2, codec="e2m1",
                                                 stochastic_rounding=True)))
    assert w.precision == "bf16" and w.opt.defaults.get("fused")
    losses = _steps(w, 4)
    assert all(math.isfinite(x) for x in losses)
    assert all(t.dtype == torch.float32 and t.is_cuda for frag in w.sync.outer for t in frag)
    assert w.sync.generator.device.type == "cuda"


@cuda
@pytest.mark.parametrize("method", ["diloco", "eager"])
def test_a_cuda_worker_with_muon_and_the_sparse_exchange_keeps_its_error_feedback_on_the_gpu(method: str) -> None:
    torch.manual_seed(0)
    cfg = replace(_cfg(inner_optimizer="muon"),
                  outer=OuterConfig(method=method, inner_steps=2, topk=4, topk_chunk=64, error_feedback=0.9))
    w = Worker(GPT(SMALL).cuda(), InProcessGroup(1).communicator(0), Stream(), cfg)
    losses = _steps(w, 6)
    assert all(math.isfinite(x) for x in losses)
    buffers = [t for frag in w.sync.feedback.buffers for t in frag]
    assert all(t.is_cuda and t.dtype == torch.float32 for t in buffers)
    assert any(bool(t.abs().sum() > 0) for t in buffers)  # what the top 4 of 64 left out is kept


def _flat_exchange(device: str, codec: str, transport: str) -> tuple[list[torch.Tensor], list[int]]:
    """Three in-process workers' means of one exchange through a transport whose bytes stay flat in M, and the bytes
    each sent."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5000, generator=g) * (1 + m) for m in range(3)]  # a partial last chunk and shard
    c = get_codec(codec, topk=32, chunk=1024, shared=True).for_step(3) if transport == "shared-support" else \
        get_codec(codec)
    grp = InProcessGroup(3)
    handles = [grp.communicator(m).allreduce_mean([x.to(device)], c, transport=transport)
               for m, x in enumerate(inputs)]
    return [h.wait()[0] for h in handles], [cm.stats.bytes_sent for cm in grp.communicators]


@cuda
@pytest.mark.parametrize(("codec", "transport"),
                         [("e2m1", "reduce-scatter"), ("int8", "reduce-scatter"), ("2bit", "shared-support")])
def test_the_flat_transports_on_cuda_give_the_cpus_mean_and_bytes(codec: str, transport: str) -> None:
    """The reduce-scatter of a dense codec and the shared support (docs/algorithms.md section 7) from device memory:
    every worker's mean is the CPU run's, bit for bit, on the GPU, and each worker sends the same bytes."""
    (cpu, cpu_bytes), (gpu, gpu_bytes) = (_flat_exchange(d, codec, transport) for d in ("cpu", "cuda"))
    assert all(m.is_cuda for m in gpu)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True))
    assert cpu_bytes == gpu_bytes and min(cpu_bytes) > 0


@cuda
@pytest.mark.parametrize("method", ["diloco", "streaming", "eager"])
def test_a_quorum_exchange_on_cuda_merges_a_late_window_as_the_cpu_does(method: str) -> None:
    """Worker 2 stalls 3 s in its third step (1 s steps, H = 4) under Q = 2: its window misses an exchange, is held
    in device memory by the party and merged into the fragment's next one (docs/algorithms.md 12.4); every worker
    ends with the CPU run's parameters and counters."""
    extra = {"fragments": 2} if method == "streaming" else {}
    cfg = OuterConfig(method=method, inner_steps=4, quorum=2, grace="0.5", **extra, **plain_sgd_outer(0.7))
    cpu, gpu = (StalledGroup(cfg, stall={2: 3.0}, device=d).run(16).finish() for d in ("cpu", "cuda"))
    straggler = gpu[2].communicators[2].stats
    assert straggler.quorum_missed == straggler.late_merged > 0 and straggler.late_dropped == 0
    counts = [[{k: v for k, v in c.stats.as_dict().items() if k != "overhead_s"} for c in run[2].communicators]
              for run in (cpu, gpu)]  # overhead_s: measured wall time
    assert counts[0] == counts[1]
    for a, b in zip(cpu[1], gpu[1], strict=True):
        assert all(t.is_cuda for f in b.outer for t in f)
        for f, g in zip(a.outer, b.outer, strict=True):
            for x, y in zip(f, g, strict=True):
                torch.testing.assert_close(y.cpu(), x, rtol=1e-5, atol=1e-6)


def test_ranks_that_would_share_a_gpu_are_named_before_nccl_refuses_them() -> None:
    from eagerloco.comm.groups import shared_gpu

    assert shared_gpu(range(2), 1) == (0, 1)  # two workers on one GPU: NCCL's "Duplicate GPU detected"
    assert shared_gpu(range(8), 8) is None
    assert shared_gpu(range(0, 4, 2), 2) == (0, 2)  # outer ranks 0 and 2 of 2x2 on 2 GPUs: both on GPU 0
    assert shared_gpu(range(1, 4, 2), 4) is None
    assert shared_gpu([], 1) is None
