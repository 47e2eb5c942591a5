"""The conversion error, apart from the package's __init__ so that its submodules import it without a cycle."""

from mtpjax.errors import MtpjaxError


class ConvertError(MtpjaxError, ValueError):
    """Conversion is impossible as asked; the message is one line naming the problem and the fix."""
