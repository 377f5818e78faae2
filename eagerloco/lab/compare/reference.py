"""The committed seeded, tuned comparison as data shipped in the package: what `eagerloco demo` runs at.

``tuned_400.json`` holds the protocol, the outer lr chosen per method and each row's loss and paired difference
to no overlap with their 90% t intervals; it is made by
``python -m eagerloco.lab.compare.reference bench/results/compare_seeds_400``. Imports no torch.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagerloco.config import ConfigError, TrainConfig
from eagerloco.lab.compare.grid import BASELINES
from eagerloco.lab.compare.seeded import TUNE_SEED_OFFSET
from eagerloco.lab.compare.stats import LEVEL, mean_interval
from eagerloco.lab.compare.tune import value_text

REFERENCE_FILE = Path(__file__).resolve().with_name("tuned_400.json")
SOURCE = "bench/results/compare_seeds_400"
#: The protocol's settings as compare flags: (TrainConfig field, flag). The demo passes the same ones.
PROTOCOL_FLAGS = (("tokenizer", "--tokenizer"), ("batch_size", "--batch-size"), ("seq_len", "--seq-len"),
                  ("steps", "--steps"), ("inner_steps", "--inner-steps"), ("sim_step_time", "--sim-step-time"))
#: The settings a run must share with the comparison for its numbers to be one more sample of it.
PROTOCOL_KEYS = ("model", "data", "tokenizer", "iid", "batch_size", "seq_len", "steps", "lr", "weight_decay",
                 "warmup_steps", "grad_clip", "eval_batches", "workers", "inner_steps", "outer_optimizer",
                 "outer_momentum", "outer_nesterov", "codec", "bandwidth_gbps", "latency_ms", "sim_step_time",
                 "inner_optimizer")


def _interval(values: list[float]) -> dict[str, float] | None:
    iv = mean_interval(values)
    return None if iv is None else {"mean": iv.mean, "lo": iv.lo, "hi": iv.hi}


def protocol_of(base: dict[str, Any]) -> dict[str, Any]:
    """The settings of :data:`PROTOCOL_KEYS` from ``asdict(TrainConfig)``, flattened (a setting added since the
    summary was written had its default)."""
    flat = {**_defaults(), **base, **base["outer"], **base["link"]}
    return {k: flat[k] for k in PROTOCOL_KEYS}


def _defaults() -> dict[str, Any]:
    """Every setting's default, flattened: what a summary or reference written before a setting existed ran."""
    d = asdict(TrainConfig())
    return {**d, **d["outer"], **d["link"]}


def seeded_command(summary: dict[str, Any], out: str = "runs/compare_seeds_400") -> str:
    """The `eagerloco compare` command line that reruns the seeded comparison into ``out``, tuning included."""
    b = summary["base_config"]
    flat = {**b, **b["outer"]}
    parts = ["eagerloco compare", *(f"{flag} {value_text(flat[k])}" for k, flag in PROTOCOL_FLAGS)]
    parts.append("--threads 1")
    parts.append(f"--seeds {len(summary['seeds'])}")
    if summary["seeds"][0] != 0:
        parts.append(f"--seed {summary['seeds'][0]}")
    if summary["tune"] and summary["tune_seed"] != summary["seeds"][0] + TUNE_SEED_OFFSET:
        parts.append(f"--tune-seed {summary['tune_seed']}")
    for axis in summary["tune"]:
        parts.append(f"--tune {axis['key']}={','.join(f'{v:g}' for v in axis['values'])}")
    parts.append("--grid " + ",".join(n for n in summary["grid"] if n not in BASELINES))
    parts.append(f"--out {out}")
    return " ".join(parts)


def reference_from_summary(summary: dict[str, Any], source: str = SOURCE) -> dict[str, Any]:
    """The shipped data from a seeded, tuned comparison's summary.json: the command, seeds, tuning, protocol,
    choices, and per row the losses, mean and paired difference to no overlap (nats and percent), each with its
    interval; ConfigError for another kind of comparison or one without a no-overlap row."""
    if summary.get("kind") != "seeded-grid" or not isinstance(summary.get("rows"), list):
        raise ConfigError(f"{source}: not the summary.json of a seeded comparison without an H sweep")
    rows = {r["unit"]: r for r in summary["rows"]}
    if "no-overlap" not in rows:
        raise ConfigError(f"{source}: the comparison has no no-overlap row to measure differences against")
    ref = {int(s): float(v) for s, v in rows["no-overlap"]["losses"].items()}
    out_rows = {}
    for name, r in rows.items():
        losses = {int(s): float(v) for s, v in r["losses"].items()}
        shared = sorted(set(losses) & set(ref))
        out_rows[name] = {
            "label": r["label"],
            "outer_lr": r["outer_lr"],
            "tuned": name in summary["chosen"],
            "losses": {str(s): losses[s] for s in sorted(losses)},
            "loss": _interval(list(losses.values())),
            "delta": None if name == "no-overlap" else _interval([losses[s] - ref[s] for s in shared]),
            "delta_pct": None if name == "no-overlap" else _interval([100 * (losses[s] / ref[s] - 1) for s in shared]),
            "diverged_seeds": list(r["diverged_seeds"]),
            "spiked_seeds": list(r["spiked_seeds"]),
            "compute_utilization": r["compute_utilization"],
        }
    return {
        "source": source,
        "command": seeded_command(summary),
        "seeds": list(summary["seeds"]),
        "level": LEVEL,
        "tune": summary["tune"],
        "tune_seed": summary["tune_seed"],
        "protocol": protocol_of(summary["base_config"]),
        "chosen": summary["chosen"],
        "rows": out_rows,
    }


def load_reference(path: Path = REFERENCE_FILE) -> dict[str, Any]:
    """The shipped reference; ConfigError when it is missing or is none (a broken install: reinstall the package)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), dict):
            raise ValueError("no rows")
        if not isinstance(data.get("protocol"), dict):
            raise ValueError("no protocol")
        # A setting added since the comparison ran had its default then.
        data["protocol"] = {**{k: v for k, v in _defaults().items() if k in PROTOCOL_KEYS}, **data["protocol"]}
    except (OSError, ValueError) as e:
        raise ConfigError(f"the demo's tuned settings {path} are missing or unreadable ({e}); reinstall eagerloco "
                          "(`pip install -e .` from the repository)") from e
    return data


def tuned_settings(reference: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """{entry name: setting} the comparison's sweep chose for these grid entries (absent: not tuned there)."""
    return {n: dict(reference["chosen"][n]) for n in names if n in reference["chosen"]}


def main(argv: list[str] | None = None) -> int:
    """Write :data:`REFERENCE_FILE` from a seeded comparison's directory (default the committed one)."""
    args = sys.argv[1:] if argv is None else argv
    source = args[0] if args else SOURCE
    summary = json.loads((Path(source) / "summary.json").read_text())
    data = reference_from_summary(summary, source.rstrip("/"))
    REFERENCE_FILE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {REFERENCE_FILE} from {source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
