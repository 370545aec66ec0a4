"""Generate text with a Llama/Qwen model (`tqjax.commands.generate`)."""
from tqjax.commands.generate import main

if __name__ == "__main__":
    main()
