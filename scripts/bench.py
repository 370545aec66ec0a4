"""Benchmark throughput, memory and the roofline; one JSON (`tqjax.commands.bench`)."""
from tqjax.commands.bench import main

if __name__ == "__main__":
    main()
