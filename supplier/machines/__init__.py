"""How a worker runs machines (the map is docs/architecture.md's)."""
