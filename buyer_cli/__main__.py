from buyer_cli.cli import main

main()
