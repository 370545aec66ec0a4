"""Quantize a model's weights into a checkpoint directory (`tqjax.commands.quantize`)."""
from tqjax.commands.quantize import main

if __name__ == "__main__":
    main()
