"""The load-test harness (``bourse loadtest``): a simulated fleet on real processes, a
seeded workload, open- or closed-loop load, and a report compared with two references:
the raw NATS request-reply ceiling and an omniscient central oracle."""
