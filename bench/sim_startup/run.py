"""Start-up time of ``eagerloco simulate`` (``python -m eagerloco.sim``), which must not import torch.

Run from the repository root: ``.venv/bin/python bench/sim_startup/run.py [--repeats N]``.
Times whole processes (interpreter start included), median of N, for a few typical commands, and
``import torch`` alone for scale. Writes bench/results/sim_startup.json and sim_startup.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
COMMANDS = {
    "simulate --help": ["-m", "eagerloco.sim", "--help"],
    "simulate --model 1b --paper --bandwidth-gbps 5": [
        "-m", "eagerloco.sim", "--model", "1b", "--paper", "--bandwidth-gbps", "5"],
    "simulate --plan --model 10b --bandwidth-gbps 2 --target-cu 0.95": [
        "-m", "eagerloco.sim", "--plan", "--model", "10b", "--bandwidth-gbps", "2", "--target-cu", "0.95"],
    "simulate --paper --compare-reference": ["-m", "eagerloco.sim", "--paper", "--compare-reference"],
    "import torch (for scale)": ["-c", "import torch"],
}


def time_once(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    for name, cmd in COMMANDS.items():
        time_once(cmd)  # warm the file cache
        times = [time_once(cmd) for _ in range(args.repeats)]
        rows.append({"command": name, "median_s": statistics.median(times), "min_s": min(times), "times_s": times})
        print(f"{name}: median {rows[-1]['median_s']:.3f} s")
    report = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
              "loadavg": [round(x, 2) for x in os.getloadavg()], "repeats": args.repeats, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sim_startup.json").write_text(json.dumps(report, indent=1) + "\n")
    md = ["# Start-up time of `eagerloco simulate`", "",
          f"Whole process (`python -m eagerloco.sim ...`, interpreter start included), median of {args.repeats} "
          f"after one warm-up run; Python {report['python']}, {report['cpus']} CPUs, load average "
          f"{report['loadavg']}. The simulator imports no torch; `import torch` alone is shown for scale.", "",
          "| command | median s | min s |", "|---|---|---|"]
    md += [f"| `{r['command']}` | {r['median_s']:.3f} | {r['min_s']:.3f} |" for r in rows]
    (args.out_dir / "sim_startup.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out_dir / 'sim_startup.json'} and {args.out_dir / 'sim_startup.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
