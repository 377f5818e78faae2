"""Tools for testing eagerloco itself (fault injection, a scripted communicator), beside the package in the
checkout: never installed."""
