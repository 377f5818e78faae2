"""Installs eagerloco's fault injection in every process started with this directory on PYTHONPATH
(:func:`testing.faults.environment`)."""

from testing.faults import install

install()
