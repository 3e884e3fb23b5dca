"""The ``buyer`` program: typer commands over the buyer's library, bourse.client."""
