"""``python -m cachet.router``: the router, configured from ``CACHET_*`` variables."""

from cachet.router.main import main

main()
