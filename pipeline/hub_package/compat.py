"""The package again where `kernels` before 0.11 imports it (build/<variant>/<name>/), as the
`kernels` requirements ask of every build variant: the variant's own `__init__.py`, run as a
package whose modules are the variant's files, and its symbols here."""

import importlib.util
import sys
from pathlib import Path

_root = Path(__file__).resolve().parent.parent
_name = f"{__name__}._variant"
_spec = importlib.util.spec_from_file_location(_name, _root / "__init__.py",
                                               submodule_search_locations=[str(_root)])
_variant = importlib.util.module_from_spec(_spec)
sys.modules[_name] = _variant
_spec.loader.exec_module(_variant)
layers = _variant.layers

__all__ = ["layers"]
