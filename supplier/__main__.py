from supplier.cli import app

app()
