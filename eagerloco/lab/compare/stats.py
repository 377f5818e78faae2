"""The arithmetic of a seeded comparison: Student-t intervals, paired differences, divergence.

The t CDF has a closed form for integer degrees of freedom (Abramowitz and Stegun 26.7.3-4) and the quantile is
bisected on it. Not scipy.stats.t.ppf, which gives the same numbers: scipy (a 35 MB wheel, a second to import)
would become an extra of the demo, compare and the benches for one function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Two-sided coverage of every interval in a seeded report.
LEVEL = 0.90


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom; ValueError unless df is an integer >= 1."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:  # A(t|df) = 2/pi [theta + sin cos (1 + 2/3 c^2 + 2*4/(3*5) c^4 + ...)]
        series, term = 0.0, 1.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c2 * (2 * k) / (2 * k + 1)
        a = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series) if df > 1 else 2 * theta / math.pi
    else:  # A(t|df) = sin [1 + 1/2 c^2 + 1*3/(2*4) c^4 + ...]
        series, term = 0.0, 1.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= c2 * (2 * k - 1) / (2 * k)
        a = math.sin(theta) * series
    a = min(1.0, max(0.0, a))
    return 0.5 + a / 2 if t >= 0 else 0.5 - a / 2


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with integer ``df`` (bisection on :func:`t_cdf` to 1e-12); ValueError for p outside
    (0, 1) or a bad df."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """Mean of n values with a two-sided Student-t interval (lo, hi); lo = hi = mean when n is 1."""

    mean: float
    lo: float
    hi: float
    n: int
    sd: float

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval | None:
    """The mean of ``values`` and its two-sided t interval, mean +- t_{(1+level)/2, n-1} * sd / sqrt(n).

    None without values or with a non-finite one; one value gives a zero-width interval (n = 1). ValueError for a
    level outside (0, 1)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    vals = [float(v) for v in values]
    if not vals or not all(math.isfinite(v) for v in vals):
        return None
    n = len(vals)
    mean = math.fsum(vals) / n
    if n == 1:
        return Interval(mean, mean, mean, 1, 0.0)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd)


def paired_difference(a: dict[int, float], b: dict[int, float], level: float = LEVEL) -> Interval | None:
    """Mean of a[s] - b[s] over the seeds both have, with its t interval (a paired comparison); None when no seed is
    shared or a difference is not finite."""
    shared = sorted(set(a) & set(b))
    return mean_interval([a[s] - b[s] for s in shared], level)


def unigram_entropy(counts: Sequence[int]) -> float:
    """Entropy in nats of the token frequencies (``counts`` per token id): the loss of a model that learned only them;
    ValueError when no token is counted."""
    total = sum(int(c) for c in counts)
    if total <= 0:
        raise ValueError("unigram_entropy needs at least one token")
    return -math.fsum((c / total) * math.log(c / total) for c in counts if c > 0)


def diverged(final: float, threshold: float) -> bool:
    """Whether a run diverged: its final eval loss is not finite or above ``threshold`` (the data's unigram entropy)."""
    return not math.isfinite(final) or final > threshold


def spiked(eval_losses: Sequence[float], threshold: float) -> bool:
    """Whether the eval losses (in step order) climbed back above ``threshold`` (the unigram entropy), or to a
    non-finite value, after one at or below it: an instability, even when the run recovered."""
    below = False
    for v in eval_losses:
        if v <= threshold:
            below = True
        elif below:
            return True
    return False
