"""``python -m cachet.bridge``."""

from cachet.bridge.main import main

if __name__ == "__main__":
    main()
