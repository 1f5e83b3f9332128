"""The command line's one error type: bad input, reported in one line with exit status 2 (its
own module so that every command module raises the class ``main`` catches, however the command
line was started)."""


class CliError(Exception):
    pass
