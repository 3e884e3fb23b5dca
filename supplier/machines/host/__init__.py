"""What a worker needs of its host to run machines: confinement (cgroups, rlimits) and
its machines' log files as the supplier reads them."""
