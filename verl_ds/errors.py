"""User-facing errors: the CLI prints `error: <where>: <message>` and exits 2, with no traceback."""


class ConfigError(ValueError):
    """A user mistake in a config file, an override or an argument. `where` names the key or file."""

    def __init__(self, where: str, message: str):
        self.where, self.message = where, message
        super().__init__(f"{where}: {message}")
