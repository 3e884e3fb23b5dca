"""Bourse exchange: wire protocol, subjects, the immediate-or-cancel auction, the broker."""
