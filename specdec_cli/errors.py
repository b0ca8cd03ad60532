"""Errors a user can cause: the CLI prints them as one line and exits with the code given."""

EXIT_BAD_INPUT = 2  # malformed config, bad flags, missing checkpoint, empty prompt
EXIT_CHECK_FAILED = 3  # a statistical or greedy-identity check failed (verify-distribution)
EXIT_GATE_FAILED = 4  # a benchmark gate (--min-speedup, --min-accept-length) was not met


class SpecdecError(Exception):
    """A failure with a message meant for the user; `exit_code` says which kind."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


class FetchError(SpecdecError):
    """A checkpoint that could not be downloaded (no registry or hub reachable from here)."""
