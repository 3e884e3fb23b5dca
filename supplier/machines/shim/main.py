"""The shim's command: ``python -I -S <this file> DIR [FD]`` (supplier/machines/shim/server.py).

Run isolated and without ``site``: nothing of the supplier's environment, no site-packages,
so that a shim starts in milliseconds. Its own modules are found by registering their
packages here without running the packages' ``__init__`` (which load the supplier).
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_path = _here
for _name in ("supplier.machines.shim", "supplier.machines", "supplier"):
    if _name not in sys.modules:
        _package = type(sys)(_name)
        _package.__path__ = [_path]
        sys.modules[_name] = _package
    _path = os.path.dirname(_path)

from supplier.machines.shim import server  # noqa: E402 - after the packages above

if __name__ == "__main__":
    server.main(sys.argv[1:])
