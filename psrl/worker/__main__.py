from psrl.worker.server import main

main()
