"""User-facing errors: the CLI prints `error: <where>: <message>` (one line per mistake) and exits 2,
with no traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in a config file, an override or an argument. `where` names the key or file."""

    def __init__(self, where: str, message: str):
        self.where, self.message = where, message
        super().__init__(f"{where}: {message}")

    @property
    def errors(self) -> list[ConfigError]:
        return [self]


class ConfigErrors(ConfigError):
    """Several mistakes of one config, reported together (each still one line)."""

    def __init__(self, errors: list[ConfigError]):
        self._errors = list(errors)
        first = self._errors[0]
        super().__init__(first.where, first.message)
        self.args = ("\n".join(str(e) for e in self._errors),)

    @property
    def errors(self) -> list[ConfigError]:
        return self._errors

    def __str__(self) -> str:
        return self.args[0]


def shown(value) -> str:
    """A user's value as an error line shows it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RunFailure(RuntimeError):
    """A run that cannot go on, for a reason its one line names (not a user mistake: the CLI prints
    `error: <line>` and exits 1, with no traceback)."""


def broken(*checks: tuple[bool, str, str]) -> list[ConfigError]:
    """The rules that failed, as ConfigErrors: each check is `(bad, key, message)`."""
    return [ConfigError(key, message) for bad, key, message in checks if bad]


def raise_all(errors: list[ConfigError]) -> None:
    """Raise what was collected: nothing, the one error, or all of them."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def real_number(value) -> float | None:
    """A user function's number (a reward): a finite real (bool, int, float, a one-element numpy or torch
    scalar) as a float; None for anything else (None, a string, NaN, inf)."""
    import math
    import numbers

    if getattr(value, "shape", None) is not None and getattr(value, "size", None) is not None:
        if (value.numel() if callable(value.size) else value.size) == 1:  # a torch or numpy scalar
            value = value.item()
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def callable_name(fn) -> str:
    """`module:qualname` of a user's function, as a config names it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', None) or shown(fn)}"


def where(e: BaseException) -> str:
    """`file:line` of an exception: a syntax error's own, else the innermost frame of its traceback."""
    import traceback

    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
