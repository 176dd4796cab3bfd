"""Errors that are the user's to fix: reported as one line naming the key or file, never as a traceback."""


class ConfigError(ValueError):
    """A configuration value, file or combination that cannot run; the message names the key or path."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
