"""A machine's shim: the contract (contract.py), the supplier's side (client.py) and the
shim itself (server.py, started as main.py), with what the shim needs of its own: its log
files (logfiles.py) and the removal of what a machine held (teardown.py). Nothing here
may import more than the standard library but client.py: the shim runs these modules
without the supplier's packages (main.py)."""
