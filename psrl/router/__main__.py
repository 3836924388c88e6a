from psrl.router.server import main

main()
