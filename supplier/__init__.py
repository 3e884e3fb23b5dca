"""Bourse supplier daemon: one (or many virtual) workers selling their capacity."""
