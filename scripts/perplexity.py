"""Perplexity of a model on a text, in non-overlapping windows (`tqjax.commands.perplexity`)."""
from tqjax.commands.perplexity import main

if __name__ == "__main__":
    main()
