"""Containers through an OCI runtime: the spec (bundle.py), its user (users.py), the
runtime on this host (runtime.py), a machine's box and writable layer (boxes.py), and the
kind the runner starts (kind.py)."""
