from edge.cli import main

main()
