"""``edge serve``: the edge's data plane (docs/edge.md)."""
