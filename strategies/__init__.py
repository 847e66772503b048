"""The run_config-to-strategy factory the fedlmc Flower apps use (``build_strategy``). The strategy
classes themselves are the library's: ``fedlmc.strategies``."""
