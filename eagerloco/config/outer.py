"""The outer algorithm's settings (one object for every method of the family) and the link's."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from eagerloco.codec_sizes import CODEC_NAMES
from eagerloco.config.checks import check_choice, check_int_at_least, check_switch, flag_name, is_finite, setting
from eagerloco.errors import ConfigError
from eagerloco.schedule import PATTERNS, apply_delay

METHODS = ("dp", "diloco", "streaming", "delayed", "eager")
WEIGHTINGS = ("nonlocal", "stale_average")
#: average: plain averaging with an outer lr (SGD without momentum), as SparseLoCo steps its outer model.
OUTER_OPTIMIZERS = ("sgd", "average", "adam", "adamw")
#: How an exchange moves: all-gathered payloads, a reduce-scatter with one requantization, or sparse positions
#: every worker draws alike so that the values are reduce-scattered.
TRANSPORTS = ("allgather", "reduce-scatter", "shared-support")
MAX_ROUNDS_IN_FLIGHT = 64
#: Slower than this (1 kbit/s) no link carries a model's outer gradient in any useful time.
MIN_BANDWIDTH_GBPS = 1e-6
#: The block formats' largest block: one scale per 65,536 values already gives up what blocks are for.
MAX_CODEC_BLOCK = 1 << 16
#: Past this outer learning rate every outer step overshoots many times over: the papers use 0.4 to 1, a shared
#: support of k of every C values, which sends each value about once in C / k rounds, up to about C / k.
MAX_OUTER_LR = 100.0
#: The slowest worker's speed is at least the fastest's over this: beyond it one step of the slowest outlasts a run.
MAX_SPEED_RATIO = 1000.0
#: One-way latency beyond a minute describes no link (around the Earth is about 0.1 s).
MAX_LATENCY_MS = 60_000.0
#: The longest --grace: an hour, past which a stalled site is a site that left (--dist-timeout), not a late one.
MAX_GRACE_S = 3600.0
#: --grace auto: exchanges it looks back over, and its bounds as shares of a round's compute time (12.2).
GRACE_WINDOW, GRACE_MIN, GRACE_MAX = 8, 0.01, 0.25


def auto_grace(spreads: Iterable[float], round_compute: float) -> float:
    """--grace auto: twice the median, over the last exchanges, of how far the Q-th arrival trails the median
    one, within [1%, 25%] of a round's compute time (docs/algorithms.md, 12.2)."""
    return min(max(2.0 * statistics.median(spreads), GRACE_MIN * round_compute), GRACE_MAX * round_compute)


def check_topk(topk: int | None, chunk: int) -> None:
    """The sparse exchange's K values of every chunk of C (train's and the simulator's); ConfigError naming the flag."""
    check_int_at_least("topk_chunk", chunk, 1)
    if topk is not None:
        check_int_at_least("topk", topk, 1)
        if topk > chunk:
            raise ConfigError(f"{flag_name('topk')} ({topk}) must not exceed {flag_name('topk_chunk')} ({chunk}): it "
                              "counts the values kept in each chunk")


@dataclass
class OuterConfig:
    """What the outer algorithm does; one object describes every method of the family.

    method:
      dp         gradient mean every inner step (the baseline)
      diloco     H inner steps, blocking exchange of the mean outer gradient (P must be 1)
      streaming  P staggered fragments, each synced once per H steps, optional tau-step overlap
      delayed    naive delayed outer update: apply the mean that arrived, k rounds late
      eager      eager updates: own fresh outer gradient in place of its missing share
    """

    method: str = setting("diloco", choices=METHODS)
    """Which member of the family runs: dp, diloco, streaming, delayed or eager."""
    inner_steps: int = 50
    """H: inner steps per outer round. Each fragment is synchronized once every H inner steps."""
    fragments: int = 1
    """P: fragments of blocks synchronized one at a time, staggered (Streaming DiLoCo). 1 for DiLoCo."""
    fragment_pattern: str = setting("strided", choices=PATTERNS)
    """How blocks map to fragments: sequential (contiguous) or strided (block b in fragment b mod P)."""
    overlap_steps: int = 0
    """tau: inner steps an exchange may take before its mean is applied (the overlap of Streaming DiLoCo)."""
    alpha: float = 0.0
    """Merge weight in [0, 1] of the local fragment when an overlapped exchange lands:
    alpha*local + (1-alpha)*outer."""
    eager_rounds: int = 1
    """k: outer rounds an exchange may take for delayed and eager (the papers' k-outer-steps overlap)."""
    eager_weighting: str = setting("nonlocal", choices=WEIGHTINGS)
    """Eager's proxy: nonlocal (every outer gradient applied exactly once) or stale_average."""
    codec: str = setting("fp32", choices=CODEC_NAMES)
    """Format of the outer gradient on the link (bf16, fp8, e2m1, ...); sums stay FP32."""
    codec_block: int = 32
    """Values sharing one scale in the block formats, 1 to 65536 (MX uses 32)."""
    stochastic_rounding: bool = False
    """Round the quantized payload stochastically instead of to nearest."""
    transport: str = setting("allgather", choices=TRANSPORTS, group="compression")
    """How an exchange moves: allgather (every worker receives the M-1 payloads and sums them in
    FP32: M-1 payloads per worker) or reduce-scatter (each worker sums one shard in FP32 from the others'
    quantized shards, requantizes it to nearest and all-gathers it: about 2 payloads per worker whatever M).
    fp32 always uses a ring all-reduce. shared-support (with --topk): the K positions of every chunk are drawn
    each round from a seed every worker shares (or partly taken from the last mean: --support-guided) instead of
    each worker's largest, and only the values travel,
    through the reduce-scatter (about 2 payloads of K values per chunk whatever M; error feedback keeps the rest)."""
    support_guided: float = setting(0.0, metavar="F", group="compression", shown_default="0: every position drawn")
    """With --transport shared-support: the share F in [0, 1) of each chunk's K positions taken from the largest
    entries of the last mean every worker received of that fragment (the same on all, so no extra bytes), the
    rest drawn at random among the others so that every position is sent in time (docs/algorithms.md, 7)."""
    topk: int | None = setting(None, metavar="K", group="compression", shown_default="off: every value is sent")
    """Sparse exchange: send only the K entries of largest magnitude of every chunk of --topk-chunk values
    (their positions packed beside them, the values in --codec, e.g. 2bit). SparseLoCo: 64 of 4096."""
    topk_chunk: int = setting(4096, metavar="C", group="compression")
    """C: values per chunk of the sparse exchange (the fragment's values in model order; the last chunk may
    be shorter)."""
    error_feedback: float | None = setting(None, metavar="BETA", group="compression",
                                           shown_default="off")
    """Error feedback with decay BETA in [0, 1]: each worker keeps what its compressed exchange did not send,
    e <- BETA*e + outer gradient, sends Q(TopK(e)) and keeps the rest (SparseLoCo: 0.95)."""
    outer_optimizer: str = setting("sgd", choices=OUTER_OPTIMIZERS)
    """The outer optimizer applied to the averaged outer gradient: sgd (with --outer-momentum, Nesterov), average
    (plain averaging with --outer-lr, as SparseLoCo), adam or adamw."""
    outer_lr: float = 0.7
    """Outer learning rate, above 0 and at most 100 (the DiLoCo papers: 0.7; the eager paper lowers it to about
    0.4; a shared support of k of C values wants about C / k times more)."""
    outer_momentum: float = 0.9
    """Outer momentum (SGD) or beta1 (Adam); the papers use 0.9."""
    outer_nesterov: bool = True
    """Nesterov momentum for the outer SGD, as in the papers (--no-outer-nesterov: plain momentum)."""
    adaptive_steps: bool = setting(False, group="heterogeneous")
    """Workers of unequal speed: each worker runs H_m = max(1, round(H * r_m / r_max)) inner steps per round,
    r_m its speed (measured: an average of its inner step times, agreed by all workers a round ahead; or
    --worker-speeds), the fastest running H, and the exchange is the token-weighted mean of the outer gradients."""
    worker_speeds: list[float] = setting(factory=list, metavar="S0,S1,...", group="heterogeneous", sep=",",
                                         shown_default="equal")
    """Relative inner-step speed of each worker (1,0.5: worker 1 at half speed), positive and the slowest at
    least 1/1000 of the fastest. Emulates unequal hardware
    (a worker's step takes the fastest's time over its speed) and, with --adaptive-steps, fixes the speeds
    its rounds are sized by instead of measuring them (reproducible runs)."""

    quorum: int | None = setting(None, metavar="Q", group="faults", shown_default="every worker")
    """Quorum exchanges: an exchange closes once Q workers have contributed and the --grace window has passed
    (or when every worker has); a window that missed its exchange is merged, token-weighted, into its fragment's
    next one (docs/algorithms.md, 12). In-process, and across jobs at a coordinator (--outer-addr, --elastic too)
    with fp32 payloads."""
    grace: str | float = setting("auto", metavar="SECONDS|auto", group="faults")
    """With --quorum: seconds an exchange waits after its Q-th contribution for the others, or auto (twice the
    recent lag of the Q-th behind the median arrival, within 1% to 25% of a round's compute)."""
    max_late_rounds: int = setting(1, metavar="S", group="faults")
    """With --quorum: a window that missed its exchange may join one of the next S exchanges of its fragment;
    a staler one is dropped, with a log line (0: dropped at once)."""

    def __post_init__(self) -> None:
        if isinstance(self.grace, (int, float)) and not isinstance(self.grace, bool):
            self.grace = str(self.grace)  # ``grace = 30`` in a TOML file is the flag's text "30"

    def validate(self, num_blocks: int | None = None) -> OuterConfig:
        """Raise ConfigError on the first invalid setting (P against ``num_blocks`` when known); returns self."""
        check_choice("method", self.method, METHODS)
        check_choice("fragment_pattern", self.fragment_pattern, PATTERNS)
        check_choice("eager_weighting", self.eager_weighting, WEIGHTINGS)
        check_choice("codec", self.codec, CODEC_NAMES)
        check_choice("outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        check_choice("transport", self.transport, TRANSPORTS)
        check_int_at_least("inner_steps", self.inner_steps, 1)
        check_int_at_least("fragments", self.fragments, 1)
        check_int_at_least("eager_rounds", self.eager_rounds, 1)
        if self.eager_rounds > MAX_ROUNDS_IN_FLIGHT:
            raise ConfigError(
                f"{flag_name('eager_rounds')} must be at most {MAX_ROUNDS_IN_FLIGHT}: each round in flight keeps a "
                f"copy of the outer gradient (the papers use 1 and 2), got {self.eager_rounds}"
            )
        check_int_at_least("overlap_steps", self.overlap_steps, 0)
        check_int_at_least("codec_block", self.codec_block, 1)
        if self.codec_block > MAX_CODEC_BLOCK:
            raise ConfigError(f"{flag_name('codec_block')} must be at most {MAX_CODEC_BLOCK} values per scale "
                              f"(MX uses 32), got {self.codec_block:,}")
        for name in ("stochastic_rounding", "outer_nesterov", "adaptive_steps"):
            check_switch(name, getattr(self, name))
        self._validate_compression()
        self._validate_speeds()
        self._validate_quorum()
        if not is_finite(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{flag_name('alpha')} must be in [0, 1] (weight of the local parameters), "
                              f"got {self.alpha}")
        if not is_finite(self.outer_lr) or not 0 < self.outer_lr <= MAX_OUTER_LR:
            raise ConfigError(f"{flag_name('outer_lr')} must be a number above 0 and at most {MAX_OUTER_LR:g} "
                              f"(the papers use 0.4 to 1), got {self.outer_lr!r}")
        if not is_finite(self.outer_momentum) or not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"{flag_name('outer_momentum')} must be in [0, 1), got {self.outer_momentum}")
        if self.outer_nesterov and self.outer_optimizer == "sgd" and self.outer_momentum == 0:
            raise ConfigError(f"{flag_name('outer_nesterov')} needs {flag_name('outer_momentum')} > 0; "
                              "pass --no-outer-nesterov for plain SGD")
        self._validate_combination(num_blocks)
        return self

    def _validate_compression(self) -> None:
        check_topk(self.topk, self.topk_chunk)
        beta = self.error_feedback
        if beta is not None and (not is_finite(beta) or not 0.0 <= beta <= 1.0):
            raise ConfigError(f"{flag_name('error_feedback')} must be a decay in [0, 1] (SparseLoCo: 0.95), "
                              f"got {beta!r}")
        if self.transport == "shared-support" and self.topk is None:
            raise ConfigError(f"{flag_name('transport')} shared-support sends K values of every chunk at positions the "
                              f"workers draw alike: give {flag_name('topk')} K (and {flag_name('topk_chunk')})")
        guided = self.support_guided
        if not is_finite(guided) or not 0.0 <= guided < 1.0:
            raise ConfigError(f"{flag_name('support_guided')} must be a share in [0, 1) (below 1 so that every "
                              f"position is drawn in time and error feedback sends it), got {guided!r}")
        if guided and self.transport != "shared-support":
            raise ConfigError(f"{flag_name('support_guided')} chooses the positions of {flag_name('transport')} "
                              f"shared-support: add {flag_name('transport')} shared-support or drop it")
        if self.topk is not None and self.transport == "reduce-scatter":
            raise ConfigError(f"{flag_name('transport')} {self.transport} sums dense shards on the way; a "
                              f"{flag_name('topk')} payload keeps other positions on every worker and is all-gathered: "
                              f"drop {flag_name('topk')} or use {flag_name('transport')} allgather")
        if self.method == "dp" and (self.topk is not None or beta is not None):
            raise ConfigError(
                f"{flag_name('topk')} and {flag_name('error_feedback')} compress outer gradients; "
                f"{flag_name('method')} dp exchanges gradients every step: choose diloco, streaming, delayed or eager"
            )

    def _validate_speeds(self) -> None:
        speeds = self.worker_speeds
        if not isinstance(speeds, list) or not all(is_finite(v) and v > 0 for v in speeds):
            raise ConfigError(f"{flag_name('worker_speeds')} must be positive numbers, one per worker "
                              f"(e.g. 1,0.5), got {speeds!r}")
        if speeds and max(speeds) > MAX_SPEED_RATIO * min(speeds):
            raise ConfigError(f"{flag_name('worker_speeds')}: the slowest worker must run at least "
                              f"1/{MAX_SPEED_RATIO:g} of the fastest's speed (one of its steps would outlast the "
                              f"run), got {speeds!r}")
        if self.adaptive_steps and self.method == "dp":
            raise ConfigError(f"{flag_name('adaptive_steps')} sizes outer rounds and {flag_name('method')} dp has "
                              "none (it averages gradients every step): choose diloco, streaming, delayed or eager")

    def _validate_quorum(self) -> None:
        check_int_at_least("max_late_rounds", self.max_late_rounds, 0)
        if self.max_late_rounds > MAX_ROUNDS_IN_FLIGHT:
            raise ConfigError(f"{flag_name('max_late_rounds')} must be at most {MAX_ROUNDS_IN_FLIGHT} (each round "
                              f"late holds a window's outer gradient), got {self.max_late_rounds}")
        self.grace_seconds()
        if self.quorum is None:
            return
        check_int_at_least("quorum", self.quorum, 1)
        if self.method == "dp":
            raise ConfigError(f"{flag_name('quorum')} closes outer exchanges without every worker, and "
                              f"{flag_name('method')} dp has none (it averages gradients every step): choose diloco, "
                              "streaming, delayed or eager")
        if self.transport != "allgather":
            raise ConfigError(f"{flag_name('quorum')} merges whole payloads, late ones too, which "
                              f"{flag_name('transport')} {self.transport} sums shard by shard on the way: use "
                              f"{flag_name('transport')} allgather with {flag_name('quorum')}")

    def grace_seconds(self) -> float | None:
        """--grace in seconds (None: auto); ConfigError when it is neither auto nor seconds >= 0."""
        if self.grace == "auto":
            return None
        try:
            seconds = float(self.grace)
        except (TypeError, ValueError):
            seconds = math.nan
        if not 0 <= seconds <= MAX_GRACE_S or isinstance(self.grace, bool):
            raise ConfigError(f"{flag_name('grace')} takes seconds from 0 to {MAX_GRACE_S:g} or auto, "
                              f"got {self.grace!r}")
        return seconds

    def speed_factors(self, workers: int) -> list[float]:
        """Each worker's step time over the fastest's, from --worker-speeds (ConfigError: another number of workers)."""
        if not self.worker_speeds:
            return [1.0] * workers
        if len(self.worker_speeds) != workers:
            raise ConfigError(f"{flag_name('worker_speeds')} gives {len(self.worker_speeds)} speed(s) for {workers} "
                              "workers: give one speed per worker")
        fastest = max(self.worker_speeds)
        return [fastest / v for v in self.worker_speeds]

    def _validate_combination(self, num_blocks: int | None) -> None:
        method, fragments = flag_name("method"), flag_name("fragments")
        if self.method == "diloco" and self.fragments != 1:
            raise ConfigError(f"{method} diloco synchronizes the whole model at once, so {fragments} "
                              f"must be 1 (got {self.fragments}); use {method} streaming for P > 1")
        if self.method == "dp":
            if self.fragments != 1 or self.overlap_steps != 0:
                raise ConfigError(f"{method} dp averages gradients every step: {fragments} must be 1 and "
                                  f"{flag_name('overlap_steps')} 0 (got {self.fragments} and {self.overlap_steps})")
        if self.method in ("delayed", "eager") and self.overlap_steps != 0:
            raise ConfigError(
                f"{method} {self.method} already overlaps the exchange with whole rounds "
                f"({flag_name('eager_rounds')}); {flag_name('overlap_steps')} must be 0, got {self.overlap_steps}"
            )
        if self.method != "dp" and self.fragments > self.inner_steps:
            raise ConfigError(f"{fragments} ({self.fragments}) must not exceed {flag_name('inner_steps')} "
                              f"({self.inner_steps}): each fragment needs its own sync step within a round")
        if self.overlap_steps > 0 and self.overlap_steps * self.fragments >= self.inner_steps:
            raise ConfigError(
                f"{flag_name('overlap_steps')} must be smaller than H/P = {self.inner_steps}/{self.fragments} "
                f"so one fragment's exchange lands before the next one starts; got {self.overlap_steps}"
            )
        if num_blocks is not None and self.fragments > max(num_blocks, 1):
            raise ConfigError(f"{fragments} ({self.fragments}) is larger than the model's number of blocks "
                              f"({num_blocks}); choose 1..{max(num_blocks, 1)}")

    @property
    def per_step(self) -> bool:
        """Whether workers exchange at every inner step (the gradient mean of dp) rather than once a round."""
        return self.method == "dp"

    @property
    def apply_delay(self) -> int:
        """Inner steps between launching an exchange and applying its mean (0: blocking)."""
        return apply_delay(self.method, self.inner_steps, self.overlap_steps, self.eager_rounds)

    @property
    def rounds_in_flight(self) -> int:
        """How many outer rounds an exchange may take before it must be applied."""
        return self.eager_rounds if self.method in ("delayed", "eager") else 0


@dataclass
class LinkConfig:
    """The slow link between workers: bandwidth in Gbit/s (inf: no limit) and one-way latency."""

    bandwidth_gbps: float = math.inf
    """Link bandwidth in Gbit/s between workers (the papers' x-axis); inf: no limit."""
    latency_ms: float = 0.0
    """One-way latency added to every exchange, in milliseconds, 0 to 60000."""
    jitter_ms: float = 0.0
    """Uniform extra latency in [0, J] milliseconds per exchange, J from 0 to 60000."""

    def validate(self) -> LinkConfig:
        """Raise ConfigError on the first invalid setting; returns self for chaining."""
        bw = self.bandwidth_gbps
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or math.isnan(bw) or bw <= 0:
            raise ConfigError(
                f"--bandwidth-gbps must be a positive number of Gbit/s (inf for no limit), got {self.bandwidth_gbps}"
            )
        if self.bandwidth_gbps < MIN_BANDWIDTH_GBPS:
            raise ConfigError(
                f"--bandwidth-gbps {self.bandwidth_gbps:g} is below {MIN_BANDWIDTH_GBPS:g} Gbit/s (1 kbit/s), where "
                "one exchange would outlast any run; did you mean a larger value?"
            )
        for name in ("latency_ms", "jitter_ms"):
            v = getattr(self, name)
            if not is_finite(v) or not 0 <= v <= MAX_LATENCY_MS:
                raise ConfigError(f"{flag_name(name)} must be a number of milliseconds from 0 to {MAX_LATENCY_MS:g}, "
                                  f"got {v!r}")
        return self

    def transfer_seconds(self, nbytes: int) -> float:
        """Seconds the link needs to carry nbytes, latency included (jitter is applied by the caller); nothing
        sent (a worker alone) takes no time."""
        if nbytes <= 0:
            return 0.0
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_gbps * 1e9)
