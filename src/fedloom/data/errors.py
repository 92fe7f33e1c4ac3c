"""Errors raised while reading or validating input data."""


class DataError(ValueError):
    """A data file is missing, unreadable or malformed.

    Messages name the offending file and, where one applies, the 1-based line number,
    so that a user can fix the input without reading a traceback.
    """
