"""The error every bad-input path raises: the entry point prints its one line and exits with 2."""


class ConfigError(ValueError):
    """A config, flag or input that cannot be used; the message names the key and what is allowed."""
