"""The Flower glue below the apps: the refinement and guard computed by the clients, ``fedlmc run``
(``flwr run`` staged and watched) and ``fedlmc-superlink``."""
