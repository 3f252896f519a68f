"""The explorer's old module name, kept until notebook 07 imports :mod:`graphborrow.explorer`."""

from .explorer import *  # noqa: F401,F403
from .explorer import __all__  # noqa: F401
