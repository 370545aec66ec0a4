"""Serve a model over an OpenAI-compatible HTTP API (`tqjax.commands.serve`)."""
from tqjax.commands.serve import main

if __name__ == "__main__":
    main()
