from psrl.psmanager.server import main

main()
