"""The shim's command: ``python -I -S <this file> DIR [FD]`` (supplier/machines/shim/server.py);
and ``python -I -S <this file> enter FD``, a command entered into a running machine
(supplier/machines/shim/enter.py: ``buyer machines exec``).

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

if __name__ == "__main__":
    if sys.argv[1:2] == ["enter"]:  # a shim's DIR is an absolute path: never "enter"
        from supplier.machines.shim import enter

        enter.main(sys.argv[2:])
    else:
        from supplier.machines.shim import server

        server.main(sys.argv[1:])
