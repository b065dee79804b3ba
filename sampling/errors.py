"""The refusals every command turns into one line and exit 2 (`sampling.cli.command`); here, below
the modules that raise them, so that none of them imports the command shape they are reported by
(or the stage-file code, for a writer's error)."""


class UsageError(ValueError):
    """A flag or input the run cannot use; reported before any model or device work."""


class StageFileError(ValueError):
    """A stage file is missing, unreadable or does not match what the pipeline expects, or an
    output (a stage file, a report) cannot be written."""
