from cachet.engine.main import main

main()
