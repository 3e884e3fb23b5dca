"""Bourse buyer: the client library and the ``buyer`` / ``bourse`` commands."""
