"""Run benchmark sweeps, one process and one JSON per run (`tqjax.commands.bench_sweep`)."""
from tqjax.commands.bench_sweep import main

if __name__ == "__main__":
    main()
