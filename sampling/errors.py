"""The refusal every command turns into one line and exit 2 (`sampling.cli.command`); here, below
the modules that raise it, so that none of them imports the command shape it is reported by."""


class UsageError(ValueError):
    """A flag or input the run cannot use; reported before any model or device work."""
