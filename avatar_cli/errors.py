"""The one domain exception family. The CLI turns each into one line and an exit code."""


class AvatarError(Exception):
    """Base class: a failure the user should see as one clear line."""

    exit_code = 1


class SpecError(AvatarError):
    """The job spec is invalid: unknown key, wrong type, contradictory settings."""

    exit_code = 2


class InputError(AvatarError):
    """An input (reference, audio, model directory, output folder) is missing or unusable."""

    exit_code = 2


class RenderError(AvatarError):
    """Something failed while rendering."""

    exit_code = 1


EXIT_OK = 0
EXIT_RENDER_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
