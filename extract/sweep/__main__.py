from extract.sweep.cli import main

main()
