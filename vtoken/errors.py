"""Exceptions raised by vtoken. All derive from `VTokenError` (a `ValueError`), so one `except` catches them."""


class VTokenError(ValueError):
    """Base class: bad input to vtoken, with a message naming what was wrong and what is accepted."""


class BudgetError(VTokenError):
    """A budget that is neither a fraction in (0, 1] nor a token count >= 1."""


class UnknownMethodError(VTokenError):
    """A method name that is not registered."""


class UnsupportedModelError(VTokenError):
    """A model that no adapter handles."""


class MissingSignalError(VTokenError):
    """A method needs a score signal (e.g. [CLS] attention) that the model cannot provide."""


class AlreadyPatchedError(VTokenError):
    """`patch` called on a model that is already patched."""


class InputError(VTokenError):
    """Inputs a patched model cannot handle (shapes, placeholder counts, mask formats)."""
