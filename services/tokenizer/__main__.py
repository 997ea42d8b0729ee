"""``python -m cachet.tokenizer``: run the tokenizer service with settings from ``CACHET_*``."""

from cachet.tokenizer.main import main

if __name__ == "__main__":
    main()
