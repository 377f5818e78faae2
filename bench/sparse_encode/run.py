"""What encoding a compressed exchange costs, against the inner step it rides on.

Run from the repository root: ``.venv/bin/python bench/sparse_encode/run.py`` (see README.md beside it).

For each CPU preset (tiny, small, base) the benchmark times, on one torch thread, in the same process:

- one inner step: forward, backward and AdamW on a batch of random tokens (batch 8 x 64), the median
  of the steady steps;
- encoding and decoding the whole model's outer gradient (one exchange of DiLoCo) in each format:
  FP32, e2m1, and the sparse exchange (top k of every chunk of 4096 values, 2-bit values) at about 25%,
  6% and 1.5% of the values; and the error-feedback update around it (e <- beta e + Delta, e <- e - C).

It reports each as a multiple of one inner step and as a share of a round of H = 20 inner steps (one
exchange per round), and the bytes against FP32. Results: bench/results/sparse_encode.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
FORMATS = [("fp32", None), ("e2m1", None), ("2bit", 1024), ("2bit", 256), ("2bit", 64)]


def _median_time(fn: Any, repeats: int) -> float:
    fn()  # one untimed call: allocations, first-use costs
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inner_step_s(preset: str, steps: int) -> tuple[float, int]:
    """Median seconds of one inner step of the preset on random tokens, and its parameter count."""
    import torch

    from eagerloco.model import GPT, model_config

    torch.manual_seed(0)
    cfg = model_config(preset, vocab_size=1024, seq_len=64)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    x = torch.randint(0, cfg.vocab_size, (8, 64))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, x)
        loss.backward()
        opt.step()

    return _median_time(step, steps), sum(p.numel() for p in model.parameters())


def codec_times(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Encode, decode and error-feedback seconds of one exchange of numel values in each format."""
    import torch

    from eagerloco.codecs import get_codec
    from eagerloco.error_feedback import ErrorFeedback

    g = torch.Generator().manual_seed(1)
    delta = torch.randn(numel, generator=g) * 1e-3
    rows = []
    for name, k in FORMATS:
        codec = get_codec(name, topk=k)
        payload = codec.pack(delta)
        encode = _median_time(lambda c=codec: c.pack(delta), repeats)
        decode = _median_time(lambda c=codec, p=payload: c.unpack(p, numel), repeats)
        feedback = ErrorFeedback([[delta]], 0.95)
        own = codec.unpack(payload, numel)

        def ef(f: ErrorFeedback = feedback, o: torch.Tensor = own) -> None:
            f.add(0, [delta])
            f.sent(0, [o])

        rows.append({
            "format": name if k is None else f"top {k} of 4096, {name}",
            "kept": 1.0 if k is None else k / 4096,
            "bytes": payload.numel(),
            "x_fewer_than_fp32": 4 * numel / payload.numel(),
            "encode_s": encode, "decode_s": decode, "error_feedback_s": _median_time(ef, repeats),
        })
    return rows


def render(data: dict[str, Any]) -> str:
    lines = [
        "# bench/sparse_encode: what encoding a compressed exchange costs against the inner step",
        "",
        f"{data['machine']}; one torch thread; inner step: batch 8 x 64 tokens, AdamW; one exchange of the "
        f"whole model's outer gradient (DiLoCo), chunks of 4096; share of a round: (encode + decode + "
        f"error feedback) / (H = {data['inner_steps']} inner steps). Command: `{data['command']}`.",
        "",
        "| preset | parameters | inner step | format | bytes (x fewer than FP32) | encode | decode "
        "| error feedback | encode in inner steps | share of a round |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in data["presets"]:
        for r in p["formats"]:
            work = r["encode_s"] + r["decode_s"] + r["error_feedback_s"]
            lines.append(
                f"| {p['preset']} | {p['params']:,} | {p['step_s'] * 1e3:.1f} ms | {r['format']} | "
                f"{r['bytes']:,} ({r['x_fewer_than_fp32']:.1f}x) | {r['encode_s'] * 1e3:.2f} ms | "
                f"{r['decode_s'] * 1e3:.2f} ms | {r['error_feedback_s'] * 1e3:.2f} ms | "
                f"{r['encode_s'] / p['step_s']:.3f} | {work / (data['inner_steps'] * p['step_s']):.2%} |"
            )
    lines += ["", "Decode runs once per worker's payload (M times an exchange); the table gives one.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny,small,base")
    p.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per exchange (default 20)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    out_json, out_md = RESULTS / "sparse_encode.json", RESULTS / "sparse_encode.md"
    if args.render_only:
        out_md.write_text(render(json.loads(out_json.read_text())))
        return 0
    import torch

    torch.set_num_threads(1)
    presets = []
    for preset in args.presets.split(","):
        step_s, params = inner_step_s(preset, args.repeats + 3)
        presets.append({"preset": preset, "params": params, "step_s": step_s,
                        "formats": codec_times(params, args.repeats)})
        print(f"{preset}: {params:,} parameters, inner step {step_s * 1e3:.1f} ms", flush=True)
    data = {
        "machine": f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.machine()}, load average "
                   f"{os.getloadavg()[0]:.2f}",
        "inner_steps": args.inner_steps, "presets": presets,
        "command": "python bench/sparse_encode/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out_json.write_text(json.dumps(data, indent=1) + "\n")
    out_md.write_text(render(data))
    print(out_md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
