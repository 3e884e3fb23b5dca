"""A machine's shim: the contract (contract.py), the supplier's side (client.py; forks.py
for its fork server) and the shim itself (server.py on lines.py, its socket and loop),
forked by the supplier's fork server (forkserver.py) or started by its command (main.py),
made one way either way (command.py), with what the shim needs of its own: its log files
(logfiles.py) and the removal of what a machine held (teardown.py). Nothing here may import
more than the standard library but client.py and forks.py: the shim runs these modules
without the supplier's packages (main.py)."""
