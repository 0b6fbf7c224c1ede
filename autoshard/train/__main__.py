from autoshard.train import main

if __name__ == "__main__":      # not in a process spawned from a rank (the cpu profile's measurement)
    main()
