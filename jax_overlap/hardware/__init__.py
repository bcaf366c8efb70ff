"""The machine: chips and links, YAML link profiles, the memory model and the one
collective-cost formula. Pure Python; imports nothing else of the package."""
