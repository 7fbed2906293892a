"""jaxformer: a functional JAX/Flax Transformer training framework."""

import importlib.util as _util
import os as _os
import sys as _sys

# The recipes live in the `configs/` folder at the top of a checkout, where users look for
# them; a wheel installs that folder inside the package as `jaxformer.configs` (pyproject's
# package-dir). In a checkout, bind `jaxformer.configs` to the folder beside this package,
# so recipes import each other the same way from both (`from jaxformer.configs import ...`).
_CHECKOUT_CONFIGS = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "configs")
if (not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "configs"))
    and _os.path.isfile(_os.path.join(_CHECKOUT_CONFIGS, "__init__.py"))):
  _spec = _util.spec_from_file_location("jaxformer.configs", _os.path.join(_CHECKOUT_CONFIGS, "__init__.py"),
                                        submodule_search_locations=[_CHECKOUT_CONFIGS])
  _sys.modules["jaxformer.configs"] = _module = _util.module_from_spec(_spec)
  _spec.loader.exec_module(_module)
  configs = _module  # as an import of the subpackage would set it
