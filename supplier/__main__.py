from supplier.cli import main

main()
