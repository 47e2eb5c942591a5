"""The one exception type of the data package."""


class DataError(ValueError):
    """Bad data input (paths, files, tokenizer, sizes); the message is one line naming the problem and the fix."""
