"""One error type for everything a user can get wrong; the CLI prints it as one line."""


class UserError(Exception):
    """Bad input or an unusable environment: shown as one line, exit status 2."""
