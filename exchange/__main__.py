from exchange.cli import app

app()
