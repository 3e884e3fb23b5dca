from buyer_cli.cli import app

app()
