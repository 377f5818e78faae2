"""Compute-utilization simulator: how much of a run's wall clock each method spends computing.

Shares :mod:`eagerloco.schedule` with training, so the simulated schedule is the one that runs; the ``simulate``
subcommand is :mod:`eagerloco.sim.cli`. Nothing here imports torch.
"""
