"""Tools for testing eagerloco itself (fault injection), beside the package in the checkout: never installed."""
