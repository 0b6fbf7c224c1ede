from autoshard.train import main

main()
