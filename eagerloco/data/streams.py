"""Training streams (one per worker, iid or non-iid shards) and fixed evaluation batches."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from eagerloco.data.cache import DataError
from eagerloco.data.corpus import Corpus
from eagerloco.data.tokenizer import Tokenizer
from eagerloco.data.tokens import encode_corpus


# Each worker's stream owns a torch.Generator seeded from (seed, worker): adding a worker or resuming
# from a checkpoint never changes the batches the other workers see.
def stream_seed(seed: int, worker: int) -> int:
    """A 63-bit seed per (seed, worker): stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(f"eagerloco-stream:{seed}:{worker}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TokenStream:
    """Random windows of one worker's token shard; its own generator makes it resumable and independent."""

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        seed: int,
        groups: Sequence[str] = (),
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if tokens.numel() < seq_len + 1:
            raise DataError(
                f"a worker's shard has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use fewer workers, a shorter --seq-len or more text"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.groups = tuple(groups)
        self.batches_drawn = 0
        self._gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return self.tokens.numel()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (B, T) as int64; y is x shifted left by one token."""
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=self._gen)
        window = self.tokens[starts[:, None] + self._offsets].long()
        self.batches_drawn += 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self._gen.get_state(),
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "num_tokens": self.tokens.numel(),
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuses a state from a different shard or shape: resuming it would silently change the data."""
        for key in ("num_tokens", "batch_size", "seq_len"):
            mine = self.tokens.numel() if key == "num_tokens" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"stream state has {key}={state[key]}, this stream has {mine}")
        self._gen.set_state(state["rng"])
        self.batches_drawn = int(state["batches_drawn"])
        self.seed = int(state["seed"])


def worker_streams(
    corpus: Corpus,
    tokenizer: Tokenizer,
    workers: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    iid: bool = True,
) -> list[TokenStream]:
    """One stream per worker over its own disjoint part of the training text. iid: documents shuffled by
    ``seed`` and cut into ``workers`` equal shards; non-iid: ordered by (group, name), whole groups dealt out
    in contiguous runs (with more workers than groups, each gets part of one group, cut at documents)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    docs = corpus.train_docs
    groups = corpus.train_groups or [corpus.name] * len(docs)
    names = corpus.train_names or [str(i) for i in range(len(docs))]
    if not iid and workers > len(docs):
        raise DataError(f"non-iid sharding needs a document per worker: {len(docs)} docs, {workers} workers")
    encoded = encode_corpus(corpus, tokenizer)[0]
    if iid:
        gen = torch.Generator().manual_seed(seed)
        tokens = encoded.join(torch.randperm(len(docs), generator=gen).tolist())
        shard = tokens.numel() // workers
        mixed = sorted(set(groups))  # every shard is a random mix of all groups
        parts = [(tokens[w * shard : (w + 1) * shard], mixed) for w in range(workers)]
    else:
        order = sorted(range(len(docs)), key=lambda i: (groups[i], names[i]))
        sizes = [int(encoded.offsets[i + 1] - encoded.offsets[i]) + 1 for i in range(len(docs))]
        shards = _non_iid_shards(order, [groups[i] for i in order], [sizes[i] for i in order], workers)
        parts = [(encoded.join(idx), sorted({groups[i] for i in idx})) for idx in shards]
    return [TokenStream(tok, batch_size, seq_len, stream_seed(seed, w), groups=g) for w, (tok, g) in enumerate(parts)]


def _non_iid_shards(order: list[int], groups: list[str], sizes: list[int], workers: int) -> list[list[int]]:
    """Document indices per worker; ``order`` is sorted by group, ``groups``/``sizes`` follow it."""
    runs: list[tuple[str, int, int]] = []  # (group, start, end) in ``order``
    for k, g in enumerate(groups):
        if runs and runs[-1][0] == g:
            runs[-1] = (g, runs[-1][1], k + 1)
        else:
            runs.append((g, k, k + 1))
    if workers <= len(runs):
        cuts = _balanced_cuts([sum(sizes[s:e]) for _, s, e in runs], workers)
        return [order[runs[cuts[w]][1] : runs[cuts[w + 1] - 1][2]] for w in range(workers)]
    # More workers than groups: one worker per group, then each extra worker to the group with the
    # most text per worker that still has a document to spare (a D'Hondt allocation).
    per = [1] * len(runs)
    for _ in range(workers - len(runs)):
        spare = [j for j, (_, s, e) in enumerate(runs) if per[j] < e - s]
        j = max(spare, key=lambda j: sum(sizes[runs[j][1] : runs[j][2]]) / per[j])
        per[j] += 1
    shards: list[list[int]] = []
    for j, (_, s, e) in enumerate(runs):
        cuts = _balanced_cuts(sizes[s:e], per[j])
        shards.extend(order[s + cuts[k] : s + cuts[k + 1]] for k in range(per[j]))
    return shards


def _balanced_cuts(sizes: list[int], parts: int) -> list[int]:
    """Boundaries 0 = c0 < c1 < ... < c_parts = len(sizes) with prefix sums near k/parts of the total."""
    total = sum(sizes)
    cuts, acc, i = [0], 0, 0
    for k in range(1, parts):
        target = total * k / parts
        # Leave at least one item for each remaining part, and take at least one for this part.
        while i < len(sizes) - (parts - k) and (i < cuts[-1] + 1 or acc + sizes[i] / 2 <= target):
            acc += sizes[i]
            i += 1
        cuts.append(i)
    cuts.append(len(sizes))
    return cuts


def eval_batches(
    corpus: Corpus,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows of the held-out documents, the same everywhere: full batches only (unless too
    few windows for one); with ``max_batches``, taken evenly across the whole eval text."""
    if not corpus.eval_docs:
        raise DataError(f"{corpus.name}: no eval documents (eval_fraction was 0)")
    tokens = encode_corpus(corpus, tokenizer)[1].join()
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"{corpus.name}: eval text has {tokens.numel()} tokens, fewer than seq_len + 1")
    starts = torch.arange(n_windows) * seq_len
    n_batches = max(1, n_windows // batch_size)
    take = min(n_windows, n_batches * batch_size)
    if max_batches is not None and max_batches < n_batches:
        take = max(0, max_batches) * batch_size
        starts = starts[torch.linspace(0, n_windows - 1, take).round().long()]
    else:
        starts = starts[:take]
    window = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return [(window[b : b + batch_size, :-1], window[b : b + batch_size, 1:]) for b in range(0, take, batch_size)]
