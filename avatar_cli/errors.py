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

# What gloo and NCCL say when the rank at the other end of a collective is gone.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "ECONNRESET")


def failure_message(e: BaseException) -> str:
    """One line for an unexpected failure; a lost peer rank in words, not the backend's C++ source path."""
    text = f"{type(e).__name__}: {e}"
    if any(s in text for s in _PEER_LOST):
        return "render failed: lost the connection to another rank (it stopped or was killed)"
    return "render failed: " + text.splitlines()[0]
