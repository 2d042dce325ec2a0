"""The error every data reader raises for a record or source it cannot use."""


class DataError(ValueError):
    """A record the stage cannot use; the message names the file and line (or the record)."""
