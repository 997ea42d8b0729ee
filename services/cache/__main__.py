"""``python -m cachet.cache``: run the cache index service until SIGTERM."""

from cachet.cache.main import main

main()
