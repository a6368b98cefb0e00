"""The one exception type bad configuration raises.

Every message is a single line that names the key and, where one exists, the fix.
`megarl-train` prints it without a traceback and exits non-zero.
"""


class ConfigError(ValueError):
    """A configuration problem, reported as one line: `<dotted.key>: <what is wrong>; <fix>`."""

    # Where the error comes from a failure inside megarl or a library (a traceback): printed after
    # the one line, which ends the console's copy, so it reaches the run's log only.
    detail: str | None = None

    def __init__(self, message: str, key: str | None = None):
        self.key = key
        self.bare = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> "ConfigError":
        """The same error with `prefix.` put before its key (used while descending the tree)."""
        if not prefix:
            return self
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(self.bare, key)
