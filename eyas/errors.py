"""User-facing errors: the CLI prints their message and exits non-zero, without a traceback."""


class EyasError(Exception):
    """A mistake in user input or environment, with a message that says what is accepted."""
