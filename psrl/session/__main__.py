from psrl.session.server import main

main()
