"""Tools for testing eagerloco itself (fault injection); no public module imports this package."""
