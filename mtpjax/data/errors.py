"""The one exception type of the data package."""

from mtpjax.errors import MtpjaxError


class DataError(MtpjaxError, ValueError):
    """Bad data input (paths, files, tokenizer, sizes); the message is one line naming the problem and the fix."""


def cache_unwritable(cache, e: OSError) -> DataError:
    """The error for a data.cache_dir that cannot hold a prepared corpus."""
    return DataError(f"data.cache_dir '{cache}' is not writable ({e.strerror or e}); choose a writable data.cache_dir")
