"""``python -m cachet.usage``: the usage service, configured from ``CACHET_*`` variables."""

from cachet.usage.main import main

main()
