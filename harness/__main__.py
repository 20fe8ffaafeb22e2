from harness.main import main

main()
