"""The error every layer raises for bad input: a torch-free leaf, so that the lowest modules can raise it."""


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and the allowed values."""


__all__ = ["ConfigError"]
