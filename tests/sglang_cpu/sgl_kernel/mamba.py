"""sgl_kernel.mamba: placeholders only (see _names.py)."""

import sys

from ._names import IMPORT_TIME
from ._stub import make_function

for _name in IMPORT_TIME["sgl_kernel.mamba"]:
    setattr(sys.modules[__name__], _name, make_function(_name, __name__))
__all__ = list(IMPORT_TIME["sgl_kernel.mamba"])
