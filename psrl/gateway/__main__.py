from psrl.gateway.launcher import main

main()
