"""Installs eagerloco's fault injection in every process started with this directory on PYTHONPATH
(:func:`eagerloco.testing.faults.environment`)."""

from eagerloco.testing.faults import install

install()
