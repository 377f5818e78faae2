"""Help texts that agree with the code and the README: every outer optimizer named, and what --elastic does
for a dead worker under the launcher and across separate jobs."""

from __future__ import annotations

from eagerloco.config import OUTER_OPTIMIZERS, OuterConfig
from eagerloco.config.runtime import RuntimeConfig
from eagerloco.flags import field_docs


def test_the_outer_optimizer_help_names_every_choice() -> None:
    doc = field_docs(OuterConfig)["outer_optimizer"]
    assert all(name in doc for name in OUTER_OPTIMIZERS), doc


def test_the_elastic_help_says_a_dead_worker_comes_back_across_jobs_too() -> None:
    """Across jobs a worker started against the run under way is admitted again, as under the launcher."""
    doc = " ".join(field_docs(RuntimeConfig)["elastic"].split())
    assert "across separate jobs (--outer-addr) when started against the run" in doc and "--rejoin" in doc
    assert "when it comes back;" not in doc
