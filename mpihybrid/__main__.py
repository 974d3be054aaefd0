from mpihybrid.cli import main

main()
