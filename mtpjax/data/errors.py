"""The one exception type of the data package."""

from mtpjax.errors import MtpjaxError


class DataError(MtpjaxError, ValueError):
    """Bad data input (paths, files, tokenizer, sizes); the message is one line naming the problem and the fix."""
