"""The one user-facing error type, below everything that raises it (mmpipe.config re-exports it)."""


class ConfigError(ValueError):
    """A user-facing configuration problem: one line naming the field and what would be valid."""
